"""TRL's (and transformers', accelerate's) private hooks that grpo-exp overrides, calls by name or reads, pinned to
the release they were read in, so that an upgrade that changes one fails here, loudly, instead of in a run.

Why: GrpoExpTrainer (training/trainer.py) overrides private methods of TRL's
GRPOTrainer and of HF's Trainer, call others by name and read their private state. An upgrade that renames an
overridden method makes Python silently stop calling the override (the run still trains, without what it added);
one that changes a method's body may break what an override assumes about it (when it scores, what a round's
output holds, which counter counts what).

tests/data/trl_hooks.json records, for each hook below, the package versions it was read from, the class that
defines it, its signature and a SHA-256 of its source (comments, docstrings and layout left out, so a reformatted
release does not fail). The tests fail naming the hook, what changed (gone, moved to another class, signature,
body) and what to re-check in grpo-exp. Three more tests keep the list complete: every method GrpoExpTrainer
and EpochSeededSampler override is listed, every private name of TRL's that the trainer-facing
modules use is listed, and none of grpo-exp's own names shadows one of TRL's.

After an upgrade: read each failing hook's new source against its re-check note, adapt grpo-exp, then re-record
(the record is reviewed like code; the diff shows what was accepted):

    PYTHONPATH=. python -m tests.training.test_trl_hooks --record
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "trl_hooks.json"
PACKAGES = ("trl", "transformers", "accelerate")
RERECORD = "PYTHONPATH=. python -m tests.training.test_trl_hooks --record"

GRPO = "trl.GRPOTrainer"
TRAINER = "transformers.Trainer"
SAMPLER = "trl.trainer.utils.RepeatSampler"
OPTIMIZER = "accelerate.optimizer.AcceleratedOptimizer"


@dataclass(frozen=True)
class Hook:
    """A method of `cls` (looked up along its MRO, as the subclass sees it) that grpo-exp depends on."""

    cls: str
    name: str
    kind: str  # override: grpo-exp overrides it; called: grpo-exp calls or wraps it by name; relied on: its behaviour
    where: str
    recheck: str

    @property
    def key(self) -> str:
        return f"{self.cls.rsplit('.', 1)[-1]}.{self.name}"


@dataclass(frozen=True)
class Attribute:
    """An attribute TRL's (or HF's, accelerate's) code assigns on `self`, which grpo-exp reads or writes."""

    cls: str
    name: str
    where: str
    recheck: str

    @property
    def key(self) -> str:
        return f"{self.cls.rsplit('.', 1)[-1]}.{self.name}"


HOOKS = [
    Hook(GRPO, "_get_per_token_logps_and_entropies", "override", "training/trainer.py",
         "every scoring forward must still pass here (old, reference and training log-probs) and return "
         "(logps, entropies, aux_loss): OldLogps.stand_in's sampler log-probs, training/scoring.py's shared-prefix "
         "forward and lean saved tensors, the mismatch measured on the training forward (OldLogps.after_forward), "
         "analysis/bench/child.py's timing"),
    Hook(GRPO, "_generate_and_score_completions", "override", "training/trainer.py, training/dynamic_sampling.py",
         "the round's output keys (old_per_token_logps, sampling_per_token_logps, importance_sampling_ratio, "
         "advantages, num_items_in_batch: dynamic_sampling's _RIGHT/_LEFT/_RECOMPUTED), the advantage formula "
         "dynamic_sampling.advantages restates, that it reads vllm_importance_sampling_correction once per round "
         "(the deferred scoring toggles it) and calls _calculate_rewards once"),
    Hook(GRPO, "_calculate_rewards", "override", "training/trainer.py",
         "it must still return the gathered [completions of every process, reward functions] tensor that "
         "DynamicSampling.observe keeps as the round's rewards and StageMixing.observe counts passes in"),
    Hook(GRPO, "_prepare_inputs", "override", "training/trainer.py, training/guards.py",
         "when a new round is generated (RoundGuard.start_round restates `_step % generate_every == 0 or "
         "_buffered_inputs is None`) and that _buffered_inputs holds the round's batches in step order "
         "(OldLogps.score_round)"),
    Hook(GRPO, "_get_train_sampler", "override", "training/trainer.py",
         "it must still return a RepeatSampler, whose class EpochSeededSampler replaces in place"),
    Hook(GRPO, "_save_checkpoint", "override", "training/trainer.py, training/atomic_save.py",
         "the staging directory: everything TRL writes must go under args.output_dir or _get_output_dir (both are "
         "pointed at the staging area) so that the rename publishes a complete checkpoint"),
    Hook(TRAINER, "_save_checkpoint", "relied on", "training/atomic_save.py",
         "as TRL's _save_checkpoint: every file under the output_dir the override redirects, rotation left to "
         "the override (it rotates after publishing)"),
    Hook(GRPO, "compute_loss", "override", "training/trainer.py",
         "it must still score the batch through _get_per_token_logps_and_entropies once with grad on (the "
         "mismatch and the by-batch old log-probs are taken there) and reject return_outputs"),
    Hook(GRPO, "_compute_loss", "relied on", "training/trainer.py",
         "its use of old_per_token_logps and importance_sampling_ratio (OldLogps.weigh sets them per batch) and its one "
         "training forward per batch"),
    Hook(GRPO, "log", "override", "training/trainer.py, training/completions_log.py",
         "the _logs keys CompletionsSample reads (prompt, completion, rewards, advantages) and when TRL clears them"),
    Hook(GRPO, "training_step", "relied on", "training/guards.py, training/rollout/old_logps.py",
         "that _step counts micro-batches (RoundGuard.start_round, OldLogps.score_round's on-policy batches)"),
    Hook(GRPO, "_generate", "called", "training/rollout/trl_hook.py, analysis/bench/child.py",
         "the rollout_func contract (prompts in, prompt_ids/completion_ids/logprobs out), the vLLM weight sync "
         "enable_is_correction stubs (use_vllm, _last_loaded_step, vllm_generation.sync_weights), the bench's "
         "generation timing"),
    Hook(GRPO, "_tokenize_prompts", "called", "training/rollout/trl_hook.py",
         "it must still return (prompt_ids, images, multimodal fields) tokenized as TRL's own generate gets them"),
    Hook(GRPO, "_log_completion_extra", "called", "training/curriculum/mix.py",
         "it must still add a column beside the logged completions (_logs['extra'], completions.jsonl's stage)"),
    Hook(GRPO, "_get_output_dir", "called", "training/atomic_save.py",
         "the run directory the checkpoint override stages and publishes into"),
    Hook(GRPO, "_load_from_checkpoint", "called", "training/stage.py",
         "a finished run's resume loads the checkpoint's weights through it without training"),
    Hook(SAMPLER, "__init__", "relied on", "training/trainer.py",
         "the fields EpochSeededSampler reseeds (shuffle, seed, generator)"),
    Hook(SAMPLER, "__iter__", "override", "training/trainer.py",
         "that an epoch's order is drawn from self.generator, which EpochSeededSampler seeds per epoch"),
]

ATTRIBUTES = [
    Attribute(GRPO, "_step", "training/guards.py, training/rollout/old_logps.py, training/curriculum/mix.py",
              "micro-batches trained so far (training_step)"),
    Attribute(GRPO, "_buffered_inputs", "training/guards.py, training/rollout/old_logps.py",
              "the round's batches, None before the first round and after a resume (_prepare_inputs)"),
    Attribute(GRPO, "_metrics", "training/trainer.py, training/dynamic_sampling.py, training/rollout/old_logps.py, "
              "training/curriculum/mix.py",
              "a {'train'|'eval': {key: list}} that log averages"),
    Attribute(GRPO, "_logs", "training/completions_log.py", "the prompt/completion/rewards/advantages deques log writes"),
    Attribute(GRPO, "_tokenizer", "training/dynamic_sampling.py, training/rollout/trl_hook.py",
              "the text tokenizer (a processor's, for a VLM): its pad_token_id"),
    Attribute(GRPO, "_is_vlm", "training/rollout/trl_hook.py", "the engine declines vision-language models"),
    Attribute(GRPO, "_last_loaded_step", "training/rollout/trl_hook.py",
              "the step of the last vLLM weight sync, which enable_is_correction resets"),
    Attribute(GRPO, "use_vllm", "training/rollout/trl_hook.py, training/trainer.py",
              "the flag enable_is_correction sets so TRL applies its importance-sampling correction"),
    Attribute(GRPO, "vllm_importance_sampling_correction", "training/rollout/trl_hook.py, training/trainer.py",
              "set by enable_is_correction, toggled around a deferred round"),
    Attribute(GRPO, "vllm_generation", "training/rollout/trl_hook.py", "stubbed: its sync_weights only"),
    Attribute(GRPO, "rollout_func", "training/rollout/trl_hook.py", "the engine's rollout, called by _generate"),
    Attribute(GRPO, "reward_func_names", "training/dynamic_sampling.py", "which reward decides (correctness)"),
    Attribute(GRPO, "reward_weights", "training/dynamic_sampling.py", "a tensor, one weight a reward function"),
    Attribute(GRPO, "scale_rewards", "training/dynamic_sampling.py", "batch | group | none, as advantages reads it"),
    Attribute(GRPO, "multi_objective_aggregation", "training/dynamic_sampling.py",
              "sum_then_normalize | normalize_then_sum, as advantages reads it"),
    Attribute(GRPO, "current_gradient_accumulation_steps", "training/trainer.py",
              "the divisor of the EWC term, as TRL scales its own loss"),
    Attribute(OPTIMIZER, "_is_overflow", "training/guards.py",
              "what step_was_skipped returns, so a dropped update leaves the LR schedule alone"),
]

# modules whose `self`/`trainer`/`optimizer`/super() name TRL's objects; every private name of TRL's they use is listed
TRAINER_FACING = ["grpo_exp/training/trainer.py", "grpo_exp/training/dynamic_sampling.py",
                  "grpo_exp/training/guards.py", "grpo_exp/training/rollout/trl_hook.py",
                  "grpo_exp/training/rollout/old_logps.py", "grpo_exp/training/curriculum/mix.py",
                  "grpo_exp/training/scoring.py", "grpo_exp/training/atomic_save.py",
                  "grpo_exp/training/completions_log.py", "grpo_exp/training/plan_fit.py",
                  "grpo_exp/training/stage.py", "grpo_exp/analysis/bench/child.py"]


def load(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def normalized_source(func) -> str:
    """The function's code as ast.unparse writes it: comments, docstrings and layout left out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def bare_signature(func) -> str:
    """The parameters' names, kinds and defaults; annotations left to the source hash (their repr varies with the
    Python and torch versions, not with TRL's)."""
    sig = inspect.signature(func)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def fingerprint(hook: Hook) -> dict | None:
    """Where `hook` resolves now (the defining class, signature, source hash), or None where nothing defines it."""
    start = load(hook.cls)
    owner = next((c for c in start.__mro__ if hook.name in c.__dict__), None)
    if owner is None:
        return None
    func = inspect.unwrap(owner.__dict__[hook.name])  # TRL decorates some (profiling_decorator)
    func = getattr(func, "__func__", func)
    return {"owner": qualified(owner), "signature": bare_signature(func),
            "source_sha256": hashlib.sha256(normalized_source(func).encode()).hexdigest()}


@functools.lru_cache(maxsize=None)  # HF's Trainer is 5000 lines: parsed once a session
def assigned_on_self(cls: type) -> dict[str, frozenset[str]]:
    """name -> the `Class.method`s of cls's MRO (in the watched packages) that assign self.<name>."""
    found: dict[str, set[str]] = {}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in PACKAGES:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
                for target in targets:
                    for leaf in ast.walk(target):
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id == "self"):
                            found.setdefault(leaf.attr, set()).add(f"{klass.__qualname__}.{func.name}")
    return {name: frozenset(places) for name, places in found.items()}


def where_assigned(attribute: Attribute) -> list[str]:
    cls = load(attribute.cls)
    places = set(assigned_on_self(cls).get(attribute.name, set()))
    places |= {f"{c.__qualname__} (class attribute)" for c in cls.__mro__ if attribute.name in c.__dict__
               and c.__module__.split(".")[0] in PACKAGES}
    return sorted(places)


def versions() -> dict[str, str]:
    """The watched packages' versions, and Python's: the hash is of ast.unparse's text, which a Python release may
    lay out differently (a hash-only failure after a Python upgrade alone is that; re-record)."""
    python = ".".join(map(str, sys.version_info[:2]))
    return {**{name: importlib.metadata.version(name) for name in PACKAGES}, "python": python}


def record() -> dict:
    """The record of every hook and attribute as installed now (what --record writes)."""
    return {"recorded_with": versions(), "rerecord": RERECORD,
            "hooks": {h.key: {"kind": h.kind, "where": h.where, **(fingerprint(h) or {})} for h in HOOKS},
            "attributes": {a.key: {"where": a.where, "assigned_in": where_assigned(a)} for a in ATTRIBUTES}}


def read_record() -> dict:
    return json.loads(RECORD.read_text())


def _installed(recorded: dict) -> str:
    then, now = recorded["recorded_with"], versions()
    return ", ".join(f"{p} {then.get(p)} -> {now[p]}" if then.get(p) != now[p] else f"{p} {now[p]}" for p in now)


def hook_changes(hook: Hook, recorded: dict) -> str | None:
    """One message naming what changed in `hook` since `recorded` (the record's whole JSON), or None."""
    then, now = recorded["hooks"].get(hook.key), fingerprint(hook)
    if then is None:
        return f"{hook.key} is not in {RECORD.name}; review it and run {RERECORD}"
    changed = []
    if now is None:
        effect = "grpo-exp's override is never called" if hook.kind == "override" else "grpo-exp's call fails"
        changed.append(f"no class of {hook.cls}'s MRO defines {hook.name} any more (renamed or removed): {effect}")
    else:
        if now["owner"] != then["owner"]:
            changed.append(f"it is now defined by {now['owner']}, not {then['owner']}")
        if now["signature"] != then["signature"]:
            changed.append(f"its signature changed: {then['signature']} -> {now['signature']}")
        if now["source_sha256"] != then["source_sha256"]:
            changed.append("its body changed (source hash)")
    if not changed:
        return None
    return (f"{hook.key} ({hook.kind}, {hook.where}) changed since the record ({_installed(recorded)}): "
            f"{'; '.join(changed)}. Re-check in grpo-exp: {hook.recheck}. After review: {RERECORD}")


def attribute_changes(attribute: Attribute, recorded: dict) -> str | None:
    then, now = recorded["attributes"].get(attribute.key), where_assigned(attribute)
    if then is None:
        return f"{attribute.key} is not in {RECORD.name}; review it and run {RERECORD}"
    if now == then["assigned_in"]:
        return None
    what = ("nothing assigns it any more (renamed or removed)" if not now
            else f"it is assigned in {now}, not {then['assigned_in']}")
    return (f"{attribute.key} ({attribute.where}) changed since the record ({_installed(recorded)}): {what}. "
            f"Re-check in grpo-exp what it holds: {attribute.recheck}. After review: {RERECORD}")


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.key)
def test_each_hook_is_as_recorded(hook):
    message = hook_changes(hook, read_record())
    if message:
        pytest.fail(message, pytrace=False)


@pytest.mark.parametrize("attribute", ATTRIBUTES, ids=lambda a: a.key)
def test_each_attribute_is_still_assigned_where_recorded(attribute):
    message = attribute_changes(attribute, read_record())
    if message:
        pytest.fail(message, pytrace=False)


def test_the_record_holds_exactly_the_listed_hooks():
    recorded = read_record()
    assert set(recorded["hooks"]) == {h.key for h in HOOKS}, f"re-record after review: {RERECORD}"
    assert set(recorded["attributes"]) == {a.key for a in ATTRIBUTES}, f"re-record after review: {RERECORD}"
    assert set(recorded["recorded_with"]) == {*PACKAGES, "python"}


def overridden(ours: type, theirs: type) -> set[str]:
    """Names `ours` defines that `theirs` (or its bases) also defines; __init__ aside (it always is)."""
    plumbing = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__init__",
                "__firstlineno__", "__static_attributes__", "__parameters__", "__orig_bases__"}
    return {name for name in vars(ours) if name not in plumbing and hasattr(theirs, name)}


def test_every_override_is_listed():
    """A new override of a TRL method must be listed (and recorded), or an upgrade could drop it unnoticed."""
    from trl import GRPOTrainer
    from trl.trainer.utils import RepeatSampler

    from grpo_exp.training.trainer import EpochSeededSampler, GrpoExpTrainer

    listed = {(h.cls, h.name) for h in HOOKS if h.kind == "override"}
    found = {(GRPO, n) for n in overridden(GrpoExpTrainer, GRPOTrainer)}
    found |= {(SAMPLER, n) for n in overridden(EpochSeededSampler, RepeatSampler)}
    assert found == listed, (f"overrides not listed: {sorted(found - listed)}; listed but not overridden: "
                             f"{sorted(listed - found)} (tests/training/test_trl_hooks.py, HOOKS)")


def trls_names() -> set[str]:
    """Every attribute and method name TRL's trainer, its sampler and accelerate's optimizer define or assign."""
    names: set[str] = set()
    for dotted in (GRPO, SAMPLER, OPTIMIZER):
        cls = load(dotted)
        names |= set(dir(cls)) | set(assigned_on_self(cls))
    return names


def private_names_used(path: Path) -> dict[str, int]:
    """Private names a module reaches on self, trainer, optimizer or super(): `x._name`, or a string `"_name"`
    handed to getattr/hasattr/setattr/a wrap helper. name -> first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            if ((isinstance(value, ast.Name) and value.id in {"self", "trainer", "optimizer"})
                    or (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super")):
                name = node.attr
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("_") \
                    and not arg.value.startswith("__"):
                name = arg.value
        if name is not None:
            found.setdefault(name, node.lineno)
    return found


def test_every_private_name_of_trls_used_is_listed():
    """A private method or attribute of TRL's (HF's, accelerate's) used in the trainer-facing modules must be listed
    above, so that its record catches an upgrade that renames it; a name of grpo-exp's own that TRL also has is a
    collision (ours shadows TRL's) and fails here too."""
    theirs = trls_names()
    listed = {h.name for h in HOOKS} | {a.name for a in ATTRIBUTES}
    unlisted = []
    for rel in TRAINER_FACING:
        for name, line in private_names_used(ROOT / rel).items():
            if name in theirs and name not in listed:
                unlisted.append(f"{rel}:{line} {name}")
    assert not unlisted, (f"private names of TRL's used but not listed in HOOKS/ATTRIBUTES (or grpo-exp names that "
                          f"collide with TRL's): {unlisted}")


def test_grpo_exps_own_names_do_not_shadow_trls():
    """What GrpoExpTrainer adds (methods, attributes it assigns) must not be names TRL already uses: an upgrade
    adding `self.skipped_steps` to GRPOTrainer, say, would be overwritten by ours, or overwrite it. (Its parts, such
    as DynamicSampling, are objects of their own beside the trainer: their names cannot shadow TRL's.)"""
    from grpo_exp.training.trainer import GrpoExpTrainer

    ours: set[str] = set()
    for cls in (GrpoExpTrainer,):
        ours |= {n for n in vars(cls) if not n.startswith("__")}
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                ours.add(node.attr)
    listed = {h.name for h in HOOKS} | {a.name for a in ATTRIBUTES}
    clashes = sorted((ours - listed) & trls_names())
    assert not clashes, f"grpo-exp's own names that TRL also defines (rename ours, or list them): {clashes}"


# --- the tests must be able to fail --------------------------------------------------------------------------

def test_a_tampered_record_is_caught_naming_the_hook_and_the_change():
    recorded = read_record()
    hook = next(h for h in HOOKS if h.name == "_calculate_rewards")
    assert hook_changes(hook, recorded) is None
    tampered = json.loads(json.dumps(recorded))
    tampered["hooks"][hook.key]["source_sha256"] = "0" * 64
    message = hook_changes(hook, tampered)
    assert message and "GRPOTrainer._calculate_rewards" in message and "body changed" in message
    assert "DynamicSampling.observe" in message and RERECORD in message  # what to re-check, and how to re-record
    tampered["hooks"][hook.key]["signature"] = "(self, inputs)"
    assert "signature changed: (self, inputs) -> (self, inputs, prompts" in hook_changes(hook, tampered)
    attribute = next(a for a in ATTRIBUTES if a.name == "_buffered_inputs")
    tampered["attributes"][attribute.key]["assigned_in"] = ["GRPOTrainer.elsewhere"]
    assert "GRPOTrainer._buffered_inputs" in attribute_changes(attribute, tampered)


def test_a_changed_renamed_or_moved_method_of_trls_is_caught(monkeypatch):
    from trl import GRPOTrainer

    recorded = read_record()
    rewards = next(h for h in HOOKS if h.name == "_calculate_rewards")

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list, extra=None):
        return None  # another body and another signature, as an upgrade might bring

    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", _calculate_rewards)
    message = hook_changes(rewards, recorded)
    assert "signature changed" in message and "body changed" in message
    monkeypatch.delattr(GRPOTrainer, "_calculate_rewards")  # renamed away: our override would never run
    assert "no class of trl.GRPOTrainer's MRO defines _calculate_rewards" in hook_changes(rewards, recorded)
    assert "override is never called" in hook_changes(rewards, recorded)
    # TRL dropping its own override: the name now resolves to HF's, which our override would call instead
    prepare = next(h for h in HOOKS if h.name == "_prepare_inputs")
    monkeypatch.delattr(GRPOTrainer, "_prepare_inputs")
    assert "now defined by transformers.trainer.Trainer" in hook_changes(prepare, recorded)


def test_an_attribute_trl_no_longer_assigns_is_caught(monkeypatch):
    import trl.trainer.grpo_trainer as grpo_trainer

    attribute = next(a for a in ATTRIBUTES if a.name == "_buffered_inputs")
    real = inspect.getsource

    def renamed(obj):  # GRPOTrainer's source as if an upgrade had renamed the buffer
        text = real(obj)
        return text.replace("self._buffered_inputs", "self._batches") if obj is grpo_trainer.GRPOTrainer else text

    monkeypatch.setattr(inspect, "getsource", renamed)
    assigned_on_self.cache_clear()
    try:
        message = attribute_changes(attribute, read_record())
    finally:
        monkeypatch.undo()
        assigned_on_self.cache_clear()  # the other tests read the real source again
    assert message and "nothing assigns it any more" in message and "GRPOTrainer._buffered_inputs" in message


def test_a_new_unlisted_private_name_is_caught(tmp_path):
    module = tmp_path / "uses.py"
    module.write_text("def f(trainer):\n"
                      "    return trainer._current_train_step_time, getattr(trainer, '_signature_columns')\n")
    assert set(private_names_used(module)) == {"_current_train_step_time", "_signature_columns"}
    assert {"_current_train_step_time", "_signature_columns"} <= trls_names()


def main(argv: list[str]) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("trl_hooks")
    if argv != ["--record"]:
        log.error("usage: %s", RERECORD)
        return 2
    data = record()
    missing = [key for key, entry in data["hooks"].items() if "owner" not in entry]
    if missing:
        log.error("not found in the installed packages (fix HOOKS first): %s", ", ".join(missing))
        return 1
    RECORD.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    log.info("recorded %d hooks and %d attributes with %s in %s", len(data["hooks"]), len(data["attributes"]),
             ", ".join(f"{k} {v}" for k, v in data["recorded_with"].items()), RECORD.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
