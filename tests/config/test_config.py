"""Every config option composes and validates; bad overrides fail with one line before any model loads."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from grpo_exp.config.checks import validate
from grpo_exp.config.speed import resolve
from grpo_exp.base.errors import ConfigError
from grpo_exp.training.trainer import grpo_config
from tests.conftest import CONF_DIR, assert_fails_fast_with_one_line, compose_cfg, run_module

GROUPS = ["model", "stage", "reward", "quantization", "cpu", "train", "speed", "logger", "paths", "debug"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_validates(tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "custom"):
        overrides.append("model.id=org/some-model")
    if (group, option) in (("stage", "gsm8k"), ("stage", "prompts")):  # their data is the user's
        overrides.append(f"stage.path={tmp_path}")
    cfg = compose_cfg(overrides, tmp_path)
    validate(cfg)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if group == "stage":
        assert cfg.stage.name == option


def test_stage_overrides_train_but_command_line_wins(tmp_path):
    assert compose_cfg(["stage=advanced"], tmp_path).train.max_completion_length == 128
    cfg = compose_cfg(["stage=advanced", "train.max_completion_length=40"], tmp_path)
    assert cfg.train.max_completion_length == 40


def test_train_config_maps_onto_grpo_config(tmp_path):
    cfg = compose_cfg(["train.learning_rate=3e-5", "train.num_generations=2", "train.precision=fp32",
                       "train.top_entropy_quantile=0.5", "train.epsilon_high=0.28",
                       "train.importance_sampling_level=sequence", "train.entropy_coef=0.01",
                       "train.mask_truncated_completions=true", "+train.extra.delta=1.5"], tmp_path)
    validate(cfg)
    args = grpo_config(cfg.train, tmp_path, [1.0, 0.2], [], resolve(cfg.speed, cfg.train))
    assert args.learning_rate == 3e-5 and args.num_generations == 2
    assert args.bf16 is False and args.activation_checkpointing is False and args.gradient_checkpointing is False
    assert (args.top_entropy_quantile, args.epsilon_high, args.importance_sampling_level, args.entropy_coef,
            args.mask_truncated_completions) == (0.5, 0.28, "sequence", 0.01, True)
    assert args.delta == 1.5  # any other GRPOConfig field still passes through train.extra
    assert args.reward_weights == [1.0, 0.2]
    # the default recipe generates for 2 optimizer steps at once (steps_per_generation=2)
    assert args.generation_batch_size == cfg.train.per_device_train_batch_size * cfg.train.steps_per_generation == 32


@pytest.mark.parametrize("overrides,needle", [
    (["train.num_generations=3"], "train.num_generations=3"),
    (["train.generation_batch_size=12", "train.steps_per_generation=null"], "train.generation_batch_size=12"),
    (["train.precision=fp16"], "bf16, fp32"),
    (["cpu.threads=0"], "cpu.threads=0"),
    (["cpu.omp_wait_policy=spin"], "default, passive, active"),
    (["cpu.malloc=jemalloc"], "cpu.malloc='jemalloc' is not valid; choose one of: auto, retain, glibc"),
    (["reward.funcs=[correctness,bogus]", "reward.weights=[1.0,1.0]"], "bogus"),
    (["reward.weights=[1.0]"], "weights"),
    (["stage=gsm8k", "stage.path=/no/such/gsm8k.jsonl"], "/no/such/gsm8k.jsonl"),
    (["+train.extra.not_a_field=1"], "not_a_field"),
    # the policy-loss options: a bad value names itself and what is valid
    (["train.importance_sampling_level=seq"],
     "train.importance_sampling_level='seq' is not valid; choose one of: token, sequence"),
    (["train.epsilon_high=-0.1"], "train.epsilon_high=-0.1 must be a finite number >= 0"),
    (["train.epsilon=-0.2"], "train.epsilon=-0.2 must be a finite number >= 0"),
    (["train.warmup_steps=90"], "train.warmup_steps=90 must be >= 0 and below train.max_steps=90"),
    (["train.warmup_steps=-1"], "train.warmup_steps=-1 must be >= 0"),
    (["train.entropy_coef=-0.01"], "train.entropy_coef=-0.01 must be a finite number >= 0"),
    (["train.entropy_coef=inf"], "train.entropy_coef=inf must be a finite number >= 0"),
    (["train.top_entropy_quantile=0"], "train.top_entropy_quantile=0.0 must be in (0, 1]"),
    (["train.top_entropy_quantile=1.5"], "train.top_entropy_quantile=1.5 must be in (0, 1]"),
    (["train.top_entropy_quantile=nan"], "train.top_entropy_quantile=nan must be in (0, 1]"),
    # their old spelling, from before they were train.* keys, names the new one
    (["+train.extra.epsilon_high=0.28"],
     "train.extra.epsilon_high is a train.* key: set train.epsilon_high=0.28 instead of +train.extra.epsilon_high"),
    (["+train.extra.mask_truncated_completions=true"],
     "set train.mask_truncated_completions=true instead of +train.extra.mask_truncated_completions"),
    (["speed.generation=fast"], "speed.generation='fast' is not valid; choose one of: auto, trl, engine, vllm"),
    (["speed.is_cap=0.5"], "speed.is_cap=0.5 must be a finite number >= 1"),
    # a curve's points are stopping points: its schedule may not decay towards max_steps
    (["experiment=compute_curve", "train.lr_scheduler_type=linear"],
     "train.lr_scheduler_type=linear decays towards train.max_steps"),
    (["curriculum=progressive", "curriculum.stages=[basic,expert,two_step]"], "expert"),
    # a study's seeds per method: a method option and a list of seeds
    (["+curriculum.method_seeds.replya=[1]"], "curriculum.method_seeds entry='replya' is not valid; choose one of:"),
    (["+curriculum.method_seeds.replay=[]"], "curriculum.method_seeds.replay=[] must be a non-empty list"),
])
def test_semantic_errors_are_one_line(tmp_path, overrides, needle):
    cfg = compose_cfg(overrides, tmp_path)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    message = str(info.value)
    assert needle in message and "\n" not in message


# Through the real entrypoint: exit code 2, one line on stderr naming the value, no run directory.
BAD_CLI = [
    (["model=nope"], "unknown model option 'nope'; valid choices: custom, gemma3_270m"),
    (["stage=expert"], "valid choices: advanced, basic, gsm8k, intermediate, multi_step, prompts, three_step, two_step"),
    (["train.max_steps=abc"], "train.max_steps"),
    # the speed switches that left train.*: one line naming the new key
    (["train.rollout=trl"], "train.rollout has moved: set speed.generation instead"),
    (["train.saved_tensors=lean"], "train.saved_tensors has moved: set speed.exact_shortcuts instead"),
    (["-m", "train.attention=sdpa,grouped"], "train.attention has moved: set speed.attention instead"),
    (["train.max_stepz=3"], "unknown config key 'train.max_stepz' (did you mean 'train.max_steps'?); valid keys "
                            "under train:"),
    # the group named first (as the web app's Launch tab does) must not take the blame
    (["train=default", "train.max_stepz=3"], "unknown config key 'train.max_stepz' (did you mean 'train.max_steps'?); "
                                             "valid keys under train:"),
    (["train.num_generations=3"], "does not divide the generation batch of 32"),
    (["train.importance_sampling_level=seq"],
     "train.importance_sampling_level='seq' is not valid; choose one of: token, sequence"),
    (["train.top_entropy_quantile=0"], "train.top_entropy_quantile=0.0 must be in (0, 1]"),
    (["+train.extra.top_entropy_quantile=0.2"], "set train.top_entropy_quantile=0.2 instead of +train.extra."),
    (["stage=gsm8k", "stage.path=/no/such/file.jsonl"], "/no/such/file.jsonl"),
    (["model=custom", "model.id=no-such-org/no-such-model"], "no-such-org/no-such-model"),
    (["model=custom", "model.id=/no/such/model_dir"], "/no/such/model_dir"),
    # TRL's own value checks, silent runs, launchers, shapes: each one line before anything is written
    (["model=tiny_random", "train.lr_scheduler_type=cosin"], "train.lr_scheduler_type=cosin: cosin is not a valid"),
    (["experiment=continual"], "experiment=continual is a sweep (over "),
    (["model=tiny_random", "resume=true"], "holds no run to continue"),
    (["model=tiny_random", "model.tiny_heads=3"], "model.tiny_heads=3 must divide model.tiny_hidden=64"),
    (["-m", "hydra/launcher=ray_aws", "train.seed=1,2"], "unknown hydra/launcher option 'ray_aws'"),
    (["model=tiny_randm"], "(did you mean 'tiny_random'?)"),
    (["stage=gsm8k"], "give a local copy with stage.path="),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_overrides_fail_fast_with_one_line(tmp_path, args, needle):
    assert_fails_fast_with_one_line(tmp_path / "run", args, needle)


@pytest.mark.slow
@pytest.mark.parametrize("args", [["train.num_generations=3"], ["model=custom", "model.id=/no/such/model_dir"],
                                  ["stage=gsm8k", "stage.path=/no/such/file.jsonl"],
                                  ["train.importance_sampling_level=seq"], ["+train.extra.epsilon_high=0.28"]])
def test_bad_input_is_refused_before_torch_is_imported(tmp_path, args):
    """The pre-check runs on the config alone: Python's import log (PYTHONPROFILEIMPORTTIME) of a refused run
    lists neither torch nor transformers nor trl, whose imports are most of a run's first seconds."""
    proc = run_module("grpo_exp.train", *args, f"hydra.run.dir={tmp_path / 'run'}", timeout=120,
                      env={"HF_HUB_OFFLINE": "1", "PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "grpo_exp.config.checks" in imported  # the log is there
    assert not imported & {"torch", "transformers", "trl"}, sorted(imported & {"torch", "transformers", "trl"})


def test_config_choices_match_the_code_that_implements_them():
    # The config layer validates choices before any model loads, so it keeps its own copies of the
    # lists that the lower and higher layers implement; a choice added on one side only would either be
    # refused by the config or pass it and fail after the model loaded.
    from grpo_exp.config import speed
    from grpo_exp.config.schema import StageConfig
    from grpo_exp.kernels import attention, logprob_head
    from grpo_exp.core.data.generators import LEVELS

    # the speed node's choices are the kernels' own, plus auto, which the plan resolves
    assert speed.ATTENTIONS == ("auto", *attention.CHOICES)
    assert speed.ATTENTION_DECODES == attention.DECODE_LAYOUTS
    assert speed.LOGPROB_KERNELS == ("auto", *logprob_head.CHOICES)
    assert StageConfig.DATASETS == (*LEVELS, "gsm8k", "prompts")


def test_intermediate_from_basic_experiment_composes_the_runs_the_readme_reports(tmp_path):
    # docs/log.md, "2026-11-27 — the intermediate stage": `stage=intermediate 'eval.sets=[intermediate,basic]'
    # ewc.lambda=1000 ewc.fisher_samples=64` from a basic run; the experiment's lambda-1000 job must be that run.
    experiment = OmegaConf.load(CONF_DIR / "experiment" / "intermediate_from_basic.yaml")
    assert experiment.hydra.sweeper.params["ewc.lambda"] == "0,1000"
    job = compose_cfg(["experiment=intermediate_from_basic", "ewc.lambda=1000"], tmp_path)
    by_hand = compose_cfg(["stage=intermediate", "eval.sets=[intermediate,basic]", "ewc.lambda=1000",
                           "ewc.fisher_samples=64", "ewc.fisher_norm=none"], tmp_path)  # the raw Fisher it ran with
    for group in ("stage", "train", "eval", "ewc", "reward"):
        assert job[group] == by_hand[group], group


def test_ewc_lambda_experiment_is_the_ladder_scored_on_validation(tmp_path):
    # docs/results/superseded/ewc-lambda.md ran `experiment=ladder eval.split=validation` and its branches; the experiment
    # that documents the choice must compose those runs, and differ from the ladder only in split, lambda and the
    # study's Fisher sample count (conf/method/ewc.yaml's, which the chosen lambda serves)
    params = OmegaConf.load(CONF_DIR / "experiment" / "ewc_lambda.yaml").hydra.sweeper.params
    assert params["ewc.lambda"] == "0,0.1,1,10,100"  # the normalised Fisher's scale (ewc.fisher_norm=mean)
    for lam in (0, 0.1, 1, 10, 100):
        job = compose_cfg(["experiment=ewc_lambda", f"ewc.lambda={lam}"], tmp_path)
        # the ladder keeps the raw Fisher its recorded runs had; the choice is made on the normalised one
        ran = compose_cfg(["experiment=ladder", "eval.split=validation", f"ewc.lambda={lam}", "ewc.fisher_norm=mean",
                           "ewc.fisher_samples=128"], tmp_path)
        assert job.ewc.fisher_samples == compose_cfg(["method=ewc"], tmp_path).ewc.fisher_samples
        assert job.eval.split == "validation"
        for group in ("stage", "train", "eval", "ewc", "reward", "curriculum", "model"):
            assert job[group] == ran[group], group


def test_long_ladder_grpo_is_the_long_ladder_without_ewc_branching_from_its_seed(tmp_path):
    # the page pairs the two ladders seed by seed: the plain one must differ in lambda alone, live in the EWC ladder's
    # sweep directory (one page, one base row) and take each seed's first stage from that seed's EWC job
    ewc_ladder = compose_cfg(["experiment=long_ladder", "train.seed=1"], tmp_path)
    plain = compose_cfg(["experiment=long_ladder_grpo", "train.seed=1"], tmp_path)
    assert plain.ewc["lambda"] == 0 and ewc_ladder.ewc["lambda"] > 0
    plain.ewc["lambda"] = ewc_ladder.ewc["lambda"]
    for group in ("stage", "train", "eval", "ewc", "reward", "model"):
        assert plain[group] == ewc_ladder[group], group
    branch = OmegaConf.to_container(plain.curriculum)
    assert branch.pop("branch_from") == "${hydra:sweep.dir}/seed${train.seed}"
    assert branch.pop("branch_from_missing") == "train"
    assert branch == {k: v for k, v in OmegaConf.to_container(ewc_ladder.curriculum).items()
                      if k not in ("branch_from", "branch_from_missing")}
    sweeps = [OmegaConf.to_container(OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml").hydra.sweep)
              for name in ("long_ladder", "long_ladder_grpo")]
    assert sweeps == [{"dir": "outputs/${task_name}/multiruns/long_ladder", "subdir": "seed${train.seed}"},
                      {"subdir": "seed${train.seed}_grpo"}]


def test_long_ladder_gemma_is_the_long_ladder_with_the_other_packaged_model(tmp_path):
    smol = compose_cfg(["experiment=long_ladder", "train.seed=2"], tmp_path)
    gemma = compose_cfg(["experiment=long_ladder_gemma", "train.seed=2"], tmp_path)
    assert (smol.model.name, gemma.model.name) == ("smollm2_135m", "gemma3_270m")
    for group in ("stage", "train", "eval", "ewc", "reward", "curriculum"):
        assert gemma[group] == smol[group], group
    sweep = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "experiment" / "long_ladder_gemma.yaml").hydra.sweep)
    assert sweep == {"dir": "outputs/${task_name}/multiruns/long_ladder_gemma"}  # never mixed with the 135M seeds


def test_default_choice_compares_levers_on_validation_only(tmp_path):
    spec = OmegaConf.load(CONF_DIR / "experiment" / "default_choice.yaml")
    arms = spec.hydra.sweeper.params.ablation.split(",")
    assert arms[0] == "none" and {"dynamic_sampling", "ds_60", "gens_8"} <= set(arms)
    for arm in arms:
        cfg = compose_cfg(["experiment=default_choice", f"ablation={arm}"], tmp_path)
        assert cfg.eval.split == "validation" and cfg.stage.name == "basic", arm
    ds_60 = compose_cfg(["experiment=default_choice", "ablation=ds_60"], tmp_path).train
    assert ds_60.dynamic_sampling and ds_60.max_steps == 60


def test_compute_curve_arms_run_at_least_as_much_compute_as_the_recipe_at_a_constant_rate(tmp_path):
    # dynamic sampling's steps cost about twice the recipe's: its arm (ds_240) stops at 240 steps, the others at 400
    arms = OmegaConf.load(CONF_DIR / "experiment" / "compute_curve.yaml").hydra.sweeper.params.ablation.split(",")
    assert arms == ["none", "gens_8", "ds_240"]
    steps = {}
    for arm in arms:
        train = compose_cfg(["experiment=compute_curve", f"ablation={arm}"], tmp_path).train
        assert train.lr_scheduler_type == "constant" and train.anytime, arm
        steps[arm] = (train.max_steps, train.dynamic_sampling, train.num_generations)
    assert steps == {"none": (400, False, 4), "gens_8": (400, False, 8), "ds_240": (240, True, 4)}


def test_replay_share_experiment_is_plain_grpo_on_the_validation_ladder(tmp_path):
    # docs/results/superseded/replay-share.md is read beside experiment=ewc_lambda's lambda-0 job: each share must be that
    # job with replay alone changed
    params = OmegaConf.load(CONF_DIR / "experiment" / "replay_share.yaml").hydra.sweeper.params
    assert params["curriculum.replay"] == "0.1,0.2,0.4"
    plain = compose_cfg(["experiment=ewc_lambda", "ewc.lambda=0"], tmp_path)
    for share in (0.1, 0.2, 0.4):
        job = compose_cfg(["experiment=replay_share", f"curriculum.replay={share}"], tmp_path)
        assert job.curriculum.replay == share and job.ewc["lambda"] == 0
        job.curriculum.replay = plain.curriculum.replay
        job.ewc.fisher_samples = plain.ewc.fisher_samples  # at lambda 0 no Fisher is estimated (stage.py)
        for group in ("stage", "train", "eval", "ewc", "reward", "curriculum", "model"):
            assert job[group] == plain[group], group


@pytest.mark.parametrize("experiment", ["recipe_search", "recipe_seeds"])
def test_recipe_sweeps_name_ablations_that_compose(experiment, tmp_path):
    params = OmegaConf.load(CONF_DIR / "experiment" / f"{experiment}.yaml").hydra.sweeper.params
    names = str(params["ablation"]).split(",")
    assert names[0] == "none" and len(set(names)) == len(names)
    default = compose_cfg([f"experiment={experiment}"], tmp_path)
    for name in names:
        assert (CONF_DIR / "ablation" / f"{name}.yaml").exists(), name
        job = compose_cfg([f"experiment={experiment}", f"ablation={name}"], tmp_path)
        changed = {k for k in job.train if job.train[k] != default.train[k]}
        assert (name == "none") == (not changed and job.reward == default.reward and job.stage == default.stage), name


def test_speed_trl_changes_only_the_speed_node_and_plans_plain_trls_path(tmp_path):
    # speed=trl: TRL's generate, sdpa, TRL's log-prob kernel, none of grpo-exp's shortcuts; the recipe is untouched
    from grpo_exp.config.speed import resolve

    default, trl = compose_cfg(["stage=basic"], tmp_path), compose_cfg(["stage=basic", "speed=trl"], tmp_path)
    assert default.train == trl.train and default.speed.generation == "auto"
    plan = resolve(trl.speed, trl.train)
    assert (plan.generation, plan.attention, plan.logprob_kernel) == ("trl", "sdpa", "trl")
    assert not (plan.shared_prefix or plan.lean_reference or plan.embedding_grad or plan.rollout_prepack)
    assert (plan.saved_tensors, plan.scoring, plan.rollout_dtype, plan.old_logps) == ("plain", "round", None, None)


def test_every_stage_has_the_recipes_kl_penalty_and_beta_0_turns_it_off(tmp_path):
    # docs/log.md, "2026-11-27 — a KL penalty of 0.04": chosen over seeds on the basic stage; the recipe says it once
    # (conf/train/default.yaml) and no stage sets it again
    assert compose_cfg(["stage=basic"], tmp_path).train.beta == 0.04
    assert compose_cfg(["stage=basic", "ablation=beta_0"], tmp_path).train.beta == 0.0
    assert compose_cfg(["stage=intermediate"], tmp_path).train.beta == 0.04


def test_the_recipe_decays_its_learning_rate_and_lr_constant_keeps_it(tmp_path):
    # docs/log.md, "2026-11-28 — a decaying learning rate": a decaying learning rate, chosen over seeds on the basic
    # stage; the recipe says it once (conf/train/default.yaml)
    composed = compose_cfg(["stage=basic"], tmp_path)
    basic = composed.train
    assert (basic.lr_scheduler_type, basic.learning_rate, basic.warmup_steps) == ("linear", 2e-5, 0)
    assert grpo_config(basic, tmp_path / "out", [1.0, 0.05], [], resolve(composed.speed, basic)).lr_scheduler_type == "linear"
    earlier = compose_cfg(["stage=basic", "ablation=lr_constant"], tmp_path).train
    assert {k for k in basic if basic[k] != earlier[k]} == {"lr_scheduler_type"}
    assert earlier.lr_scheduler_type == "constant"
    assert compose_cfg(["stage=intermediate"], tmp_path).train.lr_scheduler_type == "linear"


def test_a_stage_sets_only_what_differs_from_the_recipe():
    """conf/stage/*.yaml may set the completion length (answers differ in length by stage) and nothing else of
    the recipe: beta, the schedule and the learning rate are conf/train/default.yaml's alone."""
    import yaml

    for path in sorted((CONF_DIR / "stage").glob("*.yaml")):
        train = (yaml.safe_load(path.read_text()) or {}).get("train") or {}
        assert set(train) <= {"max_completion_length"}, f"{path.name} sets {sorted(train)}"
