"""A curriculum stage's config: the command line's overrides, less the ones the curriculum sets per stage, plus
the stage, its directory, the model it continues, the earlier stages it tracks and replays; composed as
`python -m grpo_exp.train <overrides>` would compose it, once per stage, and checked before the first one trains."""

from __future__ import annotations

import copy
from pathlib import Path

from grpo_exp.base.errors import ConfigError
# what the curriculum sets per stage, what names a stage, and a stage's own overrides' check live with the schema
from grpo_exp.config.curriculum_schema import _STAGE_IDENTITY, override_key, own_override_problem, set_per_stage  # noqa: F401


def stage_overrides(user_overrides: list[str], stage: str, out_dir: Path, init_from: str | None,
                    resume: bool = False, earlier: list[str] | None = None, push: bool = False,
                    replay: float = 0.0, replay_from: list[str] | None = None,
                    own: list[str] | None = None) -> list[str]:
    """`earlier`: the stages before this one, whose forgetting it tracks (eval.forgetting_sets). `push`: this
    stage uploads its model/ (push_to_hub: the last stage only, so the hub repo gets the curriculum's result).
    `replay_from`: the earlier stages whose training prompts make up the share `replay` of this one's. `own`: the
    stage's own recipe (curriculum.stage_overrides), after the command line's, so the more specific one wins."""
    names = [o for o in user_overrides if override_key(o).startswith("stage.") and override_key(o).split(".")[1] in _STAGE_IDENTITY]
    if names:
        raise ConfigError(f"{', '.join(names)}: a curriculum's stages are curriculum.stages, each with its own "
                          f"{', '.join('stage.' + k for k in _STAGE_IDENTITY)}; list the stages there, or train one "
                          f"stage (stage=<name>) without a curriculum")
    # stage.<setting> (sizes, splits) applies to every stage, over each stage's own conf/stage/<name>.yaml
    kept = [o for o in user_overrides if not set_per_stage(override_key(o))]
    extra = [f"stage={stage}", "curriculum=none", f"paths.output_dir={out_dir}", f"resume={str(resume).lower()}",
             f"push_to_hub={str(push).lower()}"]
    if init_from:
        extra.append(f"init_from={init_from}")
    if earlier and init_from:
        extra.append(f"eval.forgetting_sets=[{','.join(earlier)}]")
    # a stage is a run of its own: what an experiment or a method file set for the curriculum as a whole (its stages,
    # their recipes, branching, matching, the replay share) is reset, and the stage replays what the curriculum gives it
    replays = replay > 0 and bool(replay_from)
    # (curriculum.stage_overrides too: compose_stage empties it)
    extra += ["curriculum.stages=[]", "curriculum.branch_from=null", "curriculum.match_accuracy_of=null",
              "curriculum.branch_from_missing=error", f"curriculum.replay={replay if replays else 0}",
              f"curriculum.replay_from=[{','.join(replay_from or []) if replays else ''}]"]
    return [*kept, *(own or []), *extra]


def compose_stage(overrides: list[str]):
    """A curriculum stage's config: what `python -m grpo_exp.train <overrides>` would get (Hydra's compose API), less
    the per-stage recipes an experiment file set for the curriculum (curriculum.stage_overrides). A stage is a run of
    its own; Hydra merges a dict override into the node it names, so no `={}` override could empty it."""
    from grpo_exp.config.compose import compose

    cfg = compose("train", overrides)
    cfg.curriculum.stage_overrides = {}
    return cfg


def check_stages(stage_cfgs: list, root: Path) -> None:
    """Every stage's config (config/checks.validate), before the first one trains. A later stage continues the one
    before it, whose directory holds nothing until that one has trained: it is checked with the curriculum's own
    directory in its place, which exists and whose recorded config (.hydra/) continues the same init_from chain."""
    from grpo_exp.config.checks import validate

    Path(root).mkdir(parents=True, exist_ok=True)  # the curriculum's files go there (a Hydra job has made it)
    for stage_cfg in stage_cfgs:
        init_from = stage_cfg.get("init_from")
        if init_from and not Path(init_from).exists() and Path(init_from).parent == Path(root):
            stage_cfg = copy.deepcopy(stage_cfg)
            stage_cfg.init_from = str(root)
        validate(stage_cfg)
