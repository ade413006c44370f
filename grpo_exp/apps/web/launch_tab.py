"""The Launch tab: a form over every config group and a few train options (prefilled from the composed
config), the command it makes, Start (through App.launch, the /launch API's own check) and Stop, and the
launched run's status, progress, reward, error and log, refreshed every second."""

from __future__ import annotations

import shlex

from grpo_exp.apps import launch_bounds, launch_check
from grpo_exp.apps.launch_check import LAUNCH_GROUPS, compose_train
from grpo_exp.apps.web.common import REFUSED, verbatim
from grpo_exp.apps.web.runner import display_command, launch_state
from grpo_exp.apps.web.state import App

NO_OPTION = "(none)"  # an optional group (debug) left out
# (key, label, int or float): train options shown as numbers, prefilled from the composed config
LAUNCH_NUMBERS = [
    ("train.max_steps", "max steps", int),
    ("train.learning_rate", "learning rate", float),
    ("train.num_generations", "completions per prompt (num_generations)", int),
    ("train.per_device_train_batch_size", "completions per step (per_device_train_batch_size)", int),
    ("train.max_completion_length", "max completion tokens", int),
    ("train.temperature", "temperature", float),
    ("train.beta", "KL coefficient (beta)", float),
    ("train.seed", "seed", int),
    ("ewc.lambda", "EWC lambda", float),
    ("eval.every_steps", "held-out accuracy every N steps (0: off)", int),
]
AFTER_TRAIN = "eval.after_train"


def group_overrides(choices: dict[str, str]) -> list[str]:
    return [f"{g}={v}" for g, v in choices.items() if v and v != NO_OPTION]


def format_value(value, kind) -> str:
    if value is None:
        return "null"
    if kind is int:
        return str(int(value))
    return repr(float(value))  # 3e-05 stays 3e-05 (Hydra reads it as a float)


def form_values(choices: dict[str, str]) -> dict[str, object]:
    """The composed config's value of every number (and eval.after_train) for these group choices."""
    from omegaconf import OmegaConf

    cfg = compose_train(group_overrides(choices))
    values: dict[str, object] = {}
    for key, _, kind in LAUNCH_NUMBERS:
        value = OmegaConf.select(cfg, key)
        if key == "eval.every_steps" and value is None:
            value = 0
        values[key] = kind(value) if value is not None else None
    values[AFTER_TRAIN] = bool(OmegaConf.select(cfg, AFTER_TRAIN))
    return values


def build_overrides(choices: dict[str, str], numbers: dict[str, object], after_train: bool, extra: str) -> list[str]:
    """Every control of the form as one override each, then the extra ones: exactly what the run gets, once
    launch_check passes them. LaunchRefused for a box that cannot be split into words (an unclosed quote)."""
    overrides = group_overrides(choices)
    kinds = {key: kind for key, _, kind in LAUNCH_NUMBERS}
    for key, value in numbers.items():
        if key == "eval.every_steps" and (value is None or int(value) == 0):
            overrides.append(f"{key}=null")  # 0 in the form: periodic held-out evaluation off
        elif value is not None:
            overrides.append(f"{key}={format_value(value, kinds[key])}")
    overrides.append(f"{AFTER_TRAIN}={'true' if after_train else 'false'}")
    return overrides + launch_check.split(extra)


def launch_tab(app: App, gr, demo) -> None:
    """The Launch tab's controls and their events, inside the Blocks `demo` (gr: the gradio module)."""
    from grpo_exp.config.options import default_options, group_options

    defaults = default_options("train")
    values = form_values({g: defaults.get(g) or NO_OPTION for g in LAUNCH_GROUPS})
    gr.Markdown("Pick the config groups and train options; **Start** runs `python -m grpo_exp.train` with "
                "exactly these overrides. Picking a group refills the numbers with the values it sets (`debug=smoke`: 2 steps). "
                "**Stop** sends SIGTERM: the run ends its step and saves a checkpoint.")
    dropdowns = {}
    with gr.Row():
        for group in LAUNCH_GROUPS:
            options = group_options(group)
            default = defaults.get(group)
            if default is None:
                options = [NO_OPTION, *options]
            dropdowns[group] = gr.Dropdown(options, value=default or NO_OPTION, label=group,
                                           elem_id=f"launch-{group}", min_width=140)
    numbers = {}
    with gr.Row():
        for key, label, kind in LAUNCH_NUMBERS:
            numbers[key] = gr.Number(values[key], label=f"{key} ({label})", precision=0 if kind is int else None,
                                     elem_id=f"launch-{key.replace('.', '-')}", min_width=160)
        after_train = gr.Checkbox(values[AFTER_TRAIN], label=f"{AFTER_TRAIN} (trained vs base model at the end)",
                                  elem_id="launch-after-train")
    extra = gr.Textbox(label="more overrides (key=value ..., as on the command line)", elem_id="launch-extra",
                       placeholder="e.g. stage.num_train=200 train.save_steps=10")
    preview = gr.Code(display_command([]), language="shell", label="command", elem_id="launch-command",
                      interactive=False, wrap_lines=True)
    with gr.Row():
        start = gr.Button("Start", variant="primary", elem_id="launch-start")
        stop = gr.Button("Stop (SIGTERM, checkpoints)", variant="stop", elem_id="launch-stop")
    notice = gr.Markdown(elem_id="launch-notice")
    status = gr.Markdown("No run started from this app yet.", elem_id="launch-status")
    progress = gr.Slider(0, 100, value=0, label="progress (% of steps)", interactive=False,
                         elem_id="launch-progress")
    reward_plot = gr.LinePlot(None, x="step", y="reward", title="reward per step", height=240,
                              elem_id="launch-reward")
    error = gr.Code("", language=None, label="error (error.txt of the run)", visible=False,
                    elem_id="launch-error", interactive=False, wrap_lines=True)
    log_box = gr.Textbox("", label="log", lines=14, max_lines=14, autoscroll=True, elem_id="launch-log",
                         interactive=False)
    timer = gr.Timer(1.0)

    group_list = list(dropdowns.values())
    number_list = list(numbers.values())
    form = [*group_list, *number_list, after_train, extra]

    def read_form(args):
        choices = dict(zip(LAUNCH_GROUPS, args[:len(group_list)]))
        nums = dict(zip([k for k, _, _ in LAUNCH_NUMBERS], args[len(group_list):len(group_list) + len(number_list)]))
        return choices, nums, args[-2], args[-1]

    def show_command(*args):
        too_big = launch_bounds.request_size(str(args[-1] or ""))  # the box, before it is split
        if too_big:
            return f"# {REFUSED}{too_big}"
        try:
            overrides = build_overrides(*read_form(args))
            launch_check.check_items(overrides, app.outputs, app.launcher.cwd)  # the quick part of the check
        except (ValueError, TypeError) as err:
            return f"# {REFUSED}{err}"
        return display_command(overrides)

    def refill(*choices):
        """Numbers as the chosen groups set them (a stage sets its completion length, debug=smoke its steps)."""
        try:
            got = form_values(dict(zip(LAUNCH_GROUPS, choices)))
        except Exception as err:
            gr.Warning(f"cannot compose these choices: {str(err).splitlines()[0]}")
            return [gr.update()] * (len(number_list) + 1)
        return [got[key] for key, _, _ in LAUNCH_NUMBERS] + [got[AFTER_TRAIN]]

    def preset_model(debug_choice, model_choice):
        """debug=smoke picks its own model (tiny_random); a model named on the command line would win."""
        if debug_choice == NO_OPTION:
            return model_choice
        try:
            return str(compose_train([f"debug={debug_choice}"]).model.name)
        except Exception:
            return model_choice

    for control in form:
        control.change(show_command, form, preview, show_progress="hidden")
    for dropdown in group_list:
        dropdown.input(refill, group_list, [*number_list, after_train], show_progress="hidden")
    dropdowns["debug"].input(preset_model, [dropdowns["debug"], dropdowns["model"]], dropdowns["model"],
                             show_progress="hidden").then(refill, group_list, [*number_list, after_train],
                                                          show_progress="hidden")

    def do_start(*args):
        try:
            overrides = build_overrides(*read_form(args))
        except (ValueError, TypeError) as err:  # an unclosed quote in the box, a number field emptied
            return verbatim(f"{REFUSED}{err}"), gr.update()
        answer = app.launch(shlex.join(overrides))  # the /launch API's own function and check
        if answer.startswith(REFUSED):
            return verbatim(answer), gr.update()
        return f"Started: {verbatim(answer)}", display_command([*overrides, f"hydra.run.dir={answer}"])

    def launch(overrides: str) -> str:
        """Start `python -m grpo_exp.train` with these overrides (as typed in the Launch tab's box, e.g.
        "model=tiny_random debug=smoke"), checked as the Launch button's are; returns the run's directory,
        or one line starting "refused: " with nothing started."""
        return app.launch(overrides)

    gr.api(launch, api_name="launch")

    def do_stop():
        return app.launcher.stop()

    def tick():
        import pandas as pd

        state = launch_state(app.launcher.current)
        points = pd.DataFrame(state["points"], columns=["step", "reward"])
        return (state["status"], round(100 * state["progress"], 1), points,
                gr.update(value=state["error"], visible=bool(state["error"])), state["log"])

    start.click(do_start, form, [notice, preview])
    stop.click(do_stop, None, notice)
    timer.tick(tick, None, [status, progress, reward_plot, error, log_box], show_progress="hidden")
    demo.load(show_command, form, preview)
