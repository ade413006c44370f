"""`push_to_hub=true hub_model_id=<id>`: upload a finished run's model/ (and adapter/, into the repo's
adapter/ folder) to the Hugging Face hub with huggingface_hub, after training.

`check(cfg)` is the entrypoint's pre-check, before anything trains: the hub must be reachable (HF_HUB_OFFLINE
unset, a quick request answered) and a token must be there, or the run fails in one line. `push` runs on
rank 0 after the model card is written; a failure there (the network gone mid-run) is logged with the
command that retries it and recorded in metrics.json, and the trained run is kept either way."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_exp.base import log
from grpo_exp.base.errors import ConfigError

logger = log.get_logger(__name__)

CHECK_TIMEOUT_S = 5
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of its boolean environment variables


def offline() -> bool:
    """HF_HUB_OFFLINE set now (huggingface_hub reads it once, at import; a run may set it later)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _no_answer(err: BaseException) -> str:
    """Why a request to the hub got no answer, in one line."""
    from huggingface_hub import constants

    first = str(err).splitlines()[0][:160] if str(err) else "no answer"
    return f"{constants.ENDPOINT} did not answer: {type(err).__name__}: {first}"


def hub_unreachable(token: str) -> str | None:
    """Why the hub cannot take an upload with `token` (no answer within CHECK_TIMEOUT_S, the token refused),
    or None: one authenticated request to the hub's whoami endpoint."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    url = f"{constants.ENDPOINT}/api/whoami-v2"
    try:
        response = get_session().get(url, headers={"authorization": f"Bearer {token}"}, timeout=CHECK_TIMEOUT_S)
    except Exception as err:  # DNS, connection refused, timeout, proxy: all mean no upload
        return _no_answer(err)
    if response.status_code == 401:
        return "the hub refused the token (401); log in again with `hf auth login` or set HF_TOKEN"
    if response.status_code >= 400:
        return f"{url} answered HTTP {response.status_code}"
    return None


def hub_silent() -> str | None:
    """Why the hub does not answer an anonymous request within CHECK_TIMEOUT_S (offline mode, no network), or
    None."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if offline():
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=CHECK_TIMEOUT_S)
    except Exception as err:  # DNS, connection refused, timeout, proxy
        return _no_answer(err)
    return None


# GSM8K's train and test JSONL files written from the hub once, on a machine that reaches it
FETCH_GSM8K = ("python -c \"from datasets import load_dataset; [load_dataset('{hub_id}', '{config}', split=s)"
               ".to_json(f'gsm8k/{{s}}.jsonl') for s in ('train', 'test')]\"")


# a prompts stage's hub dataset (its train split) as a local JSONL file
FETCH_PROMPTS = ("python -c \"from datasets import load_dataset; load_dataset('{hub_id}'{config}, split='train')"
                 ".to_json('my_prompts.jsonl')\"")


def check_dataset(stage) -> None:
    """stage=gsm8k (or a prompts stage) without stage.path reads the hub at the start of training: fail now, in one
    line saying how to give a local copy, where the hub does not answer and the datasets cache does not hold it."""
    if stage.dataset not in ("gsm8k", "prompts") or stage.path:
        return
    reason = hub_silent()
    if reason is None or _cached(stage.hub_id):
        return
    if stage.dataset == "prompts":
        config = f", '{stage.hub_config}'" if stage.hub_config else ""
        raise ConfigError(f"stage.hub_id={stage.hub_id} is read from the hub, which cannot be reached ({reason}), and "
                          f"the datasets cache does not hold it; give a local copy with stage.path=<JSONL file>, "
                          f"written once where the hub answers with: "
                          f"{FETCH_PROMPTS.format(hub_id=stage.hub_id, config=config)}")
    fetch = FETCH_GSM8K.format(hub_id=stage.hub_id, config=stage.hub_config)
    raise ConfigError(f"stage.dataset=gsm8k reads {stage.hub_id} from the hub, which cannot be reached ({reason}), "
                      f"and the datasets cache does not hold it; give a local copy with stage.path=<dir holding "
                      f"train.jsonl and test.jsonl>, written once where the hub answers with: {fetch}")


def _cached(hub_id: str) -> bool:
    """The datasets cache holds a copy of `hub_id` (datasets' folder naming: org___name)."""
    try:
        from datasets import config
    except ImportError:
        return False
    return any((Path(config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")).glob("*"))


def check(cfg) -> None:
    """The pre-check of push_to_hub=true: one line and no training where the upload could not happen."""
    if not cfg.get("push_to_hub"):
        return
    from huggingface_hub import get_token

    where = f"push_to_hub=true (hub_model_id={cfg.hub_model_id})"
    if offline():
        raise ConfigError(f"{where} needs the hub, but HF_HUB_OFFLINE is set; unset it, or train without "
                          f"push_to_hub and upload model/ later with `hf upload {cfg.hub_model_id} <run>/model .`")
    token = get_token()
    if not token:
        raise ConfigError(f"{where} needs a Hugging Face token with write access; run `hf auth login` or set HF_TOKEN")
    reason = hub_unreachable(token)
    if reason:
        raise ConfigError(f"{where} cannot reach the hub: {reason}; train without push_to_hub and upload "
                          f"model/ later with `hf upload {cfg.hub_model_id} <run>/model .`")


def push(cfg, run_dir: str | Path) -> dict:
    """Create the repo (if needed) and upload model/ and adapter/; returns what metrics.json records under
    "hub": the repo, its URL and each folder's commit, or the error."""
    from huggingface_hub import HfApi

    run_dir = Path(run_dir)
    repo_id = str(cfg.hub_model_id)
    folders = [(run_dir / "model", None), (run_dir / "adapter", "adapter")]
    folders = [(path, into) for path, into in folders if path.is_dir()]
    message = f"grpo-exp: {cfg.model.name} trained with GRPO on {cfg.stage.name} ({run_dir.name})"
    try:
        api = HfApi()
        url = api.create_repo(repo_id, exist_ok=True, private=cfg.get("hub_private"))
        commits = {}
        for path, into in folders:
            info = api.upload_folder(repo_id=repo_id, folder_path=str(path), path_in_repo=into,
                                     commit_message=f"{message}: {path.name}/")
            commits[path.name] = getattr(info, "oid", None) or str(info)
    except Exception as err:
        first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        logger.error("push_to_hub: uploading %s to %s failed (%s: %s); the run is kept; retry with: hf upload %s %s .",
                     ", ".join(f"{p.name}/" for p, _ in folders), repo_id, type(err).__name__, first, repo_id,
                     run_dir / "model")
        return {"repo_id": repo_id, "error": f"{type(err).__name__}: {first}"}
    logger.info("pushed %s to %s", ", ".join(f"{p.name}/" for p, _ in folders), url)
    return {"repo_id": repo_id, "url": str(url), "commits": commits}
