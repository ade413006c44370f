"""`python -m grpo_exp.train stage=basic`: one GRPO stage, or the curriculum with `curriculum=progressive`.

A thin Hydra main: the task wrapper (apps/task.py) checks the config, sets up the CPU, records
status.json and maps errors to exit codes; grpo_exp.training does the work."""

from __future__ import annotations

from pathlib import Path

from grpo_exp.apps.task import run_task
from grpo_exp.base.io import eval_sets


def train_task(cfg) -> dict:
    """One stage, or the whole curriculum when cfg.curriculum.stages is set."""
    left_out = left_out_of_study(cfg)
    if left_out:
        from grpo_exp.base import log
        from grpo_exp.base.run_files import SKIPPED

        log.get_logger(__name__).info("%s", left_out)
        return {"status": SKIPPED}
    if isinstance(cfg.resume, str):  # resume=<run dir>: continue that directory, not the new Hydra one
        cfg.paths.output_dir = cfg.resume
    if cfg.curriculum.stages:
        from hydra.core.hydra_config import HydraConfig

        from grpo_exp.training import curriculum

        overrides = list(HydraConfig.get().overrides.task)
        if str(cfg.cpu.threads) != "auto":
            # each stage composes its own config from the overrides, and the task wrapper may have set
            # this job's threads itself (its share of the cores under a parallel launcher)
            overrides.append(f"cpu.threads={cfg.cpu.threads}")
        result = curriculum.run(cfg, overrides)
        for history in sorted(Path(cfg.paths.output_dir).glob("*/history.jsonl")):  # one per stage
            show_outputs(history.parent)
        return result
    from grpo_exp.training.stage import train

    result = train(cfg)
    show_outputs(cfg.paths.output_dir)
    if cfg.eval.after_train and cfg.eval.split == "validation":
        result = {**result, VALIDATION_ACCURACY: validation_accuracy(result.get("eval"), cfg.stage.name)}
    return result


def left_out_of_study(cfg) -> str | None:
    """Why this sweep job is skipped (its method runs on other seeds: curriculum.method_seeds), or None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not cfg.curriculum.get("method_seeds") or not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    method = hydra_cfg.runtime.choices.get("method")
    seeds = cfg.curriculum.method_seeds.get(method)
    if hydra_cfg.mode != RunMode.MULTIRUN or seeds is None or int(cfg.train.seed) in list(seeds):
        return None
    return (f"skipped: method={method} runs on train.seed {', '.join(map(str, seeds))} in this study "
            f"(curriculum.method_seeds), not on {cfg.train.seed}")


# the result's key (not written to metrics.json) for the objective of a run scored on validation after training
VALIDATION_ACCURACY = "validation_accuracy"


def validation_accuracy(evaluation, stage: str) -> float | None:
    """The trained model's accuracy on the stage's validation problems after training (metrics.json's `eval`);
    None where the evaluation failed, so a search records the trial failed rather than ranking it."""
    sets = eval_sets(evaluation)
    value = (sets.get(stage) or {}).get("accuracy")
    return float(value) if isinstance(value, (int, float)) else None


def objective(result: dict) -> float | None:
    """status.json's `objective`, what a sweeper such as hparams_search's maximises: the validation accuracy after
    training where the run scored it, else the training reward at the end (a curriculum: its average accuracy)."""
    if VALIDATION_ACCURACY in result:
        return result[VALIDATION_ACCURACY]
    return result.get("reward_mean_last", result.get("average_accuracy"))


def show_outputs(run_dir) -> None:
    """Draw the run's curves.png and say where its files are and how to look at them."""
    from grpo_exp.analysis.run_curves import write_curves
    from grpo_exp.base import dist, log

    if not dist.is_main():
        return
    curves = write_curves(run_dir)
    run_dir = Path(run_dir)
    files = [name for name in ("model", "metrics.json", "before_after.md", "eval.json", "history.jsonl",
                               "completions.jsonl", "curves.png") if (run_dir / name).exists()]
    # the make targets work from the checkout whatever is on the PATH, and install what the app needs on first use
    log.get_logger(__name__).info(
        "run files in %s: %s. Look at them with: make report ARGS=%s (tables and plots; grpo-report in the "
        "environment), make app ARGS='--outputs %s' (web app)%s", run_dir, ", ".join(files), run_dir, run_dir.parent,
        f"; curves: {curves}" if curves else "")


def check(cfg) -> None:
    """Everything a training run can check without loading a model."""
    from grpo_exp.config.checks import validate
    from grpo_exp.core.models import check_available

    # the config's own checks and the model's availability need no torch: a bad value fails in about a
    # second, not after the ~8 s that importing the training stack takes
    validate(cfg)
    check_logger_installed(cfg.logger)
    check_available(cfg.model, cfg.paths.cache_dir)
    from grpo_exp.training import hub

    hub.check(cfg)  # push_to_hub=true: the hub reachable and a token there, before anything trains
    hub.check_dataset(cfg.stage)  # stage=gsm8k without stage.path: the hub answers, or its cache holds it
    from grpo_exp.evaluation.run import check_held_out
    from grpo_exp.training import trl_args
    from grpo_exp.training.stage import check_init_from

    check_held_out(cfg)
    check_init_from(cfg)
    trl_args.check(cfg)  # TRL's own value checks (lr_scheduler_type, optim, ...) before the run directory exists


def check_logger_installed(logger_cfg) -> None:
    """logger=trackio without trackio installed would warn and train with nothing to show: one line instead."""
    import importlib.util

    from grpo_exp.base.errors import ConfigError

    if logger_cfg.name == "trackio" and importlib.util.find_spec("trackio") is None:
        raise ConfigError("logger=trackio needs the trackio package, which is not installed; make train "
                          "ARGS=logger=trackio installs it on first use (or: pip install -e '.[trackio]')")


def main() -> None:
    run_task("train", train_task, check, objective=objective)


if __name__ == "__main__":
    main()
