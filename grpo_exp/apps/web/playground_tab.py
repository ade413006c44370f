"""The Playground tab: one question (typed, or a held-out problem of the run's stage) answered by a trained
run's base model and by its model/, side by side, greedy or sampled, each answer parsed as the correctness
reward parses it."""

from __future__ import annotations

from grpo_exp.apps.launch_bounds import MAX_QUESTION_CHARS, PLAYGROUND_MAX_NEW_TOKENS
from grpo_exp.apps.web.state import App
from grpo_exp.base import log

logger = log.get_logger(__name__)


def playground_bounds(question: str, max_new) -> str | None:
    """Why a Playground request is refused (the browser may send any number and any text), or None."""
    if len(question) > MAX_QUESTION_CHARS:
        return f"the question is {len(question)} characters; the app takes at most {MAX_QUESTION_CHARS}"
    try:
        tokens = int(max_new or 0)
    except (TypeError, ValueError):
        return f"max new tokens {max_new!r} is not a whole number (0-{PLAYGROUND_MAX_NEW_TOKENS})"
    if not 0 <= tokens <= PLAYGROUND_MAX_NEW_TOKENS:
        return f"max new tokens {tokens} is outside 0-{PLAYGROUND_MAX_NEW_TOKENS} (0: the run's own)"
    return None


def playground_tab(app: App, gr) -> dict:
    from grpo_exp.analysis import playground

    gr.Markdown("One question, answered by the run's base model (its `model` option) and by its trained "
                "`model/`, with the run's system prompt. The answer is parsed as the correctness reward parses it.")
    with gr.Row():
        pick = gr.Dropdown([], label="trained run", elem_id="play-pick", scale=3)
        sample = gr.Button("a held-out problem of its stage", elem_id="play-sample")
    with gr.Row():
        question = gr.Textbox(label="question", lines=2, elem_id="play-question", scale=3)
        expected = gr.Textbox(label="expected answer (optional)", elem_id="play-expected")
    with gr.Row():
        decoding = gr.Radio(["greedy", "sampled"], value="greedy", label="decoding", elem_id="play-decoding")
        temperature = gr.Number(0.8, label="temperature (sampled)", elem_id="play-temperature")
        seed = gr.Number(0, label="seed (sampled)", precision=0, elem_id="play-seed")
        max_tokens = gr.Number(0, label=f"max new tokens (0: the run's; at most {PLAYGROUND_MAX_NEW_TOKENS})",
                               precision=0, minimum=0, maximum=PLAYGROUND_MAX_NEW_TOKENS, elem_id="play-max-tokens")
    ask = gr.Button("Answer with both", variant="primary", elem_id="play-ask")
    notice = gr.Markdown(elem_id="play-notice")
    with gr.Row():
        with gr.Column():
            base_title = gr.Markdown("### base model", elem_id="play-base-title")
            base_text = gr.Textbox(label="answer", lines=6, interactive=False, elem_id="play-base-answer")
            base_verdict = gr.Markdown(elem_id="play-base-verdict")
        with gr.Column():
            run_title = gr.Markdown("### trained run", elem_id="play-run-title")
            run_text = gr.Textbox(label="answer", lines=6, interactive=False, elem_id="play-run-answer")
            run_verdict = gr.Markdown(elem_id="play-run-verdict")
    counter = {"n": 0}

    def list_models():
        choices = app.run_choices("models")
        if not choices:
            return (gr.update(choices=[], value=None),
                    f"**No trained runs under `{app.outputs}` yet** (a run writes model/ when it ends).")
        return gr.update(choices=choices, value=choices[0][1]), ""

    def held_out(path):
        path = app.ours(path)
        if not path:
            return gr.update(), gr.update(), "Pick a trained run first."
        try:
            q, a = playground.held_out_problem(playground.run_settings(path), counter["n"])
        except Exception as err:
            return gr.update(), gr.update(), f"No held-out problem: {str(err).splitlines()[0]}"
        counter["n"] += 1
        return q, a, ""

    def verdict(answer: playground.Answer) -> str:
        parsed = "none found" if answer.predicted is None else f"{answer.predicted:g}"
        mark = {True: "correct", False: "wrong", None: "no expected answer given"}[answer.correct]
        return f"parsed answer: **{parsed}** ({mark}); {answer.tokens} tokens, {answer.seconds:.1f} s"

    def answer_both(path, q, exp, dec, temp, sd, max_new):
        blank = [gr.update()] * 6
        refused = playground_bounds(q or "", max_new)
        if refused:
            return [f"**Refused:** {refused}"] + blank
        path = app.ours(path)
        if not path:
            return ["**Pick a trained run** (one with model/)."] + blank
        if not (q or "").strip():
            return ["**Write a question** (or take a held-out problem)."] + blank
        try:
            base, trained = playground.side_by_side(app.models, path, q.strip(), expected=exp or None,
                                                    do_sample=dec == "sampled", temperature=float(temp or 0.8),
                                                    seed=int(sd or 0), max_new_tokens=int(max_new or 0) or None)
        except Exception as err:
            logger.exception("playground failed")
            return [f"**Could not answer:** {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"] + blank
        return ["", f"### {base.model}", base.text, verdict(base), f"### {trained.model}", trained.text,
                verdict(trained)]

    sample.click(held_out, pick, [question, expected, notice])
    ask.click(answer_both, [pick, question, expected, decoding, temperature, seed, max_tokens],
              [notice, base_title, base_text, base_verdict, run_title, run_text, run_verdict])
    return {"fn": list_models, "inputs": None, "outputs": [pick, notice]}
