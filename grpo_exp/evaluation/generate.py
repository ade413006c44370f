"""Ground-truth evaluation of a policy on a problem set: batched greedy (or seeded sampled)
generation, the same answer parser as the correctness reward, Wilson intervals, speed and memory.

Greedy completions decode through evaluation/fast_decode.py where it can serve the model (eval.decode=auto), else
through HF `generate`; sampled ones always through `generate`.

Heuristic measures are reported under `heuristic_*` keys and never mixed into accuracy.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from grpo_exp.base import log, stop
from grpo_exp.config.schema import EvalConfig
from grpo_exp.core import rewards
from grpo_exp.core.data import prompt_messages
from grpo_exp.base.monitor import peak_rss_mb
from grpo_exp.evaluation import fast_decode
from grpo_exp.evaluation.stats import (BOOTSTRAP_RESAMPLES, bootstrap_interval, majority_vote, pass_at_k,
                                      wilson_interval)

logger = log.get_logger(__name__)


def model_size_mb(model: torch.nn.Module) -> float:
    """Bytes held by parameters and buffers (packed int8 weights of quantized Linear layers included)."""
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(t.numel() * t.element_size() for t in model.buffers())
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)
        if packed is not None and hasattr(packed, "_weight_bias"):
            weight, bias = packed._weight_bias()
            total += weight.numel() * weight.element_size() + (bias.numel() * bias.element_size() if bias is not None else 0)
    return total / 2**20


EVAL_PRECISION = "fp32"  # every evaluation decodes in it (fp32_decoding), whatever training computed in


@contextmanager
def fp32_decoding(model: torch.nn.Module):
    """Decode `model` in fp32 whatever precision it trains in: without autocast and without the autocast
    wrapper accelerate puts on a mixed-precision policy's forward, so a model scored during training gives the
    answers its saved weights give in a fresh process (bf16 changes a quarter of a 135M model's greedy answers).
    Weights held in another floating dtype are refused, not cast: a bf16 copy is another model."""
    other = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if other:
        raise ValueError(f"evaluation decodes in {EVAL_PRECISION}, but the model holds {', '.join(other)} weights")
    wrapped = "_original_forward" in model.__dict__ and "forward" in model.__dict__
    forward = model.__dict__.pop("forward") if wrapped else None
    try:
        with torch.autocast(device_type=model_device(model).type, enabled=False):
            yield
    finally:
        if wrapped:
            model.forward = forward


@torch.no_grad()
def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's weights are (HF models say so; a plain module is asked through a parameter)."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


class StopRequested(StoppingCriteria):
    """A stop request (base/stop.py) polled after every decoded token: Stopped is raised out of `generate`, so a
    Ctrl-C ends an evaluation of hundreds of problems within a decoding step, not after the batch."""

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        stop.check("evaluation")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


_told: set[str] = set()  # the fallback reasons logged already in this process


def decode_path(model, decode: str = "auto", do_sample: bool = False) -> str:
    """Which path decodes `model`'s completions: "engine" (fast_decode.GreedyDecoder) or "generate".

    decode: eval.decode. auto: the engine where fast_decode.unsupported_reason finds nothing against the model (fp32
    weights on the CPU, no adapters, no quantized layers, ...), else generate, the reason logged once; engine: the
    engine or an error naming why not; generate: HF generate, the path published figures were computed with.
    Sampled completions (do_sample) always decode through generate, whose draws the pass@k figures are."""
    if decode not in EvalConfig.DECODES:
        raise ValueError(f"unknown eval.decode {decode!r}; choose one of {', '.join(EvalConfig.DECODES)}")
    if decode == "generate" or do_sample:
        return "generate"
    why = fast_decode.unsupported_reason(model)
    if why is None:
        return "engine"
    if decode == "engine":
        raise ValueError(f"eval.decode=engine cannot decode this model: {why} (eval.decode=auto falls back to "
                         f"generate)")
    if why not in _told:
        _told.add(why)
        logger.info("greedy evaluation decodes through generate: %s", why)
    return "generate"


def generate_completions(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int,
                         do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                         seed: int = 0, desc: str = "generating", decode: str = "auto",
                         engine_cache_mb: float | None = None) -> tuple[list[str], list[int], float, int]:
    """Completions for chat prompts: (texts, completion token counts, seconds spent generating,
    token positions decoded). A batch decodes until its longest completion ends, so positions
    include the padding after shorter completions' EOS: positions / seconds is the raw decoding
    throughput, comparable between models whose answers differ in length. `decode`: see decode_path.
    `engine_cache_mb`: the engine path's KV cache per batch (eval.engine_cache_mb; None: `batch_size` rows)."""
    engine = decode_path(model, decode, do_sample) == "engine"
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only generation needs the prompt flush against the new tokens
    was_training = model.training
    model.eval()
    try:
        with fp32_decoding(model):  # once for the whole set: its check and the unwrapping are per model
            if engine:
                texts, lengths, seconds, positions = _engine_batches(
                    model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    cache_mb=engine_cache_mb, desc=desc)
            else:
                texts, lengths, seconds, positions = _generate_batches(
                    model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, desc=desc)
    finally:  # also when a stop ends it: an evaluation during training hands the policy back as it found it
        model.train(was_training)
        tokenizer.padding_side = padding_side
    return texts, lengths, seconds, positions


def _eos_token_ids(model, tokenizer) -> list[int]:
    """The tokens that end a row in greedy `generate`: the generation config's EOS (one or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _engine_batches(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int,
                    cache_mb: float | None, desc: str) -> tuple[list[str], list[int], float, int]:
    """generate_completions' loop over batches on the engine path: the model's GreedyDecoder (built on its first
    evaluation, its compiled step reused), the prompts in batches of as many rows as a KV cache of `cache_mb` MiB
    holds (`batch_size` where None), as even as can be (200 prompts at 32 rows: 7 batches of 28-29 rows, not a last
    one of 8)."""
    decoder = fast_decode.decoder_for(model)
    eos = _eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    encoded = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, return_dict=True)["input_ids"]
    if cache_mb is not None and prompts:
        batch_size = max(1, int(cache_mb * 2**20 // decoder.row_bytes(encoded, max_new_tokens)))
    rows = -(-len(prompts) // -(-len(prompts) // batch_size)) if prompts else 1
    texts, lengths, seconds, positions = [""] * len(prompts), [0] * len(prompts), 0.0, 0
    batches = decoder.batches(encoded, rows=rows, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad)
    for held, new, spent in tqdm(batches, total=-(-len(prompts) // rows), desc=desc, leave=False):
        seconds += spent
        positions += new.numel()
        batch_texts, batch_lengths = [], []
        _append_texts(new, tokenizer, batch_texts, batch_lengths)
        for i, text, n in zip(held, batch_texts, batch_lengths):
            texts[i], lengths[i] = text, n
    return texts, lengths, seconds, positions


def _append_texts(new: torch.Tensor, tokenizer, texts: list[str], lengths: list[int]) -> None:
    """Each row's text and token count, up to and including its first EOS or pad token (the rest is padding)."""
    for row in new:
        ids = row.tolist()
        n = next((i + 1 for i, t in enumerate(ids) if t in (tokenizer.eos_token_id, tokenizer.pad_token_id)), len(ids))
        lengths.append(n)
        texts.append(tokenizer.decode(ids[:n], skip_special_tokens=True))


def _generate_batches(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, batch_size: int,
                      do_sample: bool, temperature: float, top_k: int, top_p: float, seed: int,
                      desc: str) -> tuple[list[str], list[int], float, int]:
    """generate_completions' loop over batches, the model in eval mode and fp32 and the tokenizer padding left."""
    texts, lengths, seconds, positions = [], [], 0.0, 0
    generator_seed = seed
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, leave=False):
        stop.check("evaluation")
        batch = prompts[start:start + batch_size]
        enc = tokenizer.apply_chat_template(batch, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True, padding=True).to(model_device(model))
        # use_cache: training with gradient checkpointing turns the KV cache off in the model config.
        kwargs = {"max_new_tokens": max_new_tokens, "pad_token_id": tokenizer.pad_token_id, "use_cache": True,
                  "stopping_criteria": StoppingCriteriaList([StopRequested()])}
        if do_sample:
            torch.manual_seed(generator_seed + start)
            # top_k=0 explicitly: left unset, generate filters to the 50 likeliest tokens
            kwargs.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        t0 = time.perf_counter()
        out = model.generate(**enc, **kwargs)
        seconds += time.perf_counter() - t0
        new = out[:, enc["input_ids"].shape[1]:]
        positions += new.numel()
        _append_texts(new, tokenizer, texts, lengths)
    return texts, lengths, seconds, positions


def score(examples: list[dict], texts: list[str], lengths: list[int], judge=None,
          prompts: list[list[dict]] | None = None) -> tuple[dict, list[dict]]:
    """Accuracy and format figures for generated texts against ground truth; with `judge` (a prompts stage's,
    evaluation/judge.py), a completion is correct where its eval reward reaches the threshold (`prompts`: the chat
    prompts it answered, which the reward is given)."""
    completions = list(texts)
    answers = [str(ex["answer"]) for ex in examples]
    judged = judge.scores(examples, prompts, completions) if judge is not None else None
    correct = (rewards.correctness(completions, answers) if judged is None
               else [1.0 if judge.solved(v) else 0.0 for v in judged])
    formatted = rewards.answer_format(completions, answers)
    reasoning = rewards.heuristic_reasoning(completions, answers)
    consistency = [_answer_work_consistency(t) for t in texts]
    n = len(examples)
    k = int(sum(correct))
    low, high = wilson_interval(k, n)
    samples = [
        {"question": ex["question"], "answer": str(ex["answer"]), "completion": text,
         "predicted": rewards.extract_answer(text), "correct": bool(c), "format_ok": bool(f), "tokens": length}
        for ex, text, length, c, f in zip(examples, texts, lengths, correct, formatted)
    ]
    if judged is not None:
        for row, value in zip(samples, judged):
            row["score"] = value
    metrics = {
        "n": n,
        "correct": k,
        "accuracy": k / n if n else 0.0,
        "accuracy_ci95_low": low,
        "accuracy_ci95_high": high,
        "format_compliance": sum(formatted) / n if n else 0.0,
        "mean_completion_tokens": sum(lengths) / n if n else 0.0,
        "heuristic_reasoning_presence": sum(r > 0 for r in reasoning) / n if n else 0.0,
        "heuristic_answer_work_consistency": _mean([c for c in consistency if c is not None]),
    }
    if judge is not None:  # what "correct" meant for this set
        metrics.update({"scored_by": judge.record(), "unscored": sum(v is None for v in judged)})
    return metrics, samples


def _answer_work_consistency(text: str) -> float | None:
    """Heuristic: does the stated answer appear as the result of some worked equation ("... = 12")?
    None when the completion shows no equation at all."""
    import re

    results = re.findall(r"=\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    if not results:
        return None
    answer = rewards.extract_answer(text)
    return float(any(rewards.answers_match(rewards.parse_number(r), answer) for r in results if answer is not None))


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def sample_answers(model, tokenizer, examples: list[dict], prompts: list[list[dict]], *, num_samples: int,
                   max_new_tokens: int, batch_size: int, temperature: float, seed: int,
                   desc: str, top_k: int = 0, top_p: float = 1.0,
                   judge=None) -> list[tuple[list[float | None], list[bool]]]:
    """For each problem, `num_samples` sampled completions' (parsed answers, correct or not: by `judge` where
    given), in sampling order."""
    repeated = [p for p in prompts for _ in range(num_samples)]
    texts, _, _, _ = generate_completions(model, tokenizer, repeated, max_new_tokens=max_new_tokens,
                                          batch_size=batch_size, do_sample=True, temperature=temperature,
                                          top_k=top_k, top_p=top_p, seed=seed, desc=desc)
    if judge is not None:
        correct = [judge.solved(v) for v in judge.scores([ex for ex in examples for _ in range(num_samples)],
                                                         repeated, texts)]
    else:
        answers = [str(ex["answer"]) for ex in examples for _ in range(num_samples)]
        correct = rewards.correctness(texts, answers)
    predicted = [rewards.extract_answer(t) for t in texts]
    return [(predicted[i * num_samples:(i + 1) * num_samples],
             [bool(c) for c in correct[i * num_samples:(i + 1) * num_samples]]) for i in range(len(examples))]


def sampled_metrics(examples: list[dict], drawn: list[tuple[list[float | None], list[bool]]], *,
                    pass_k: list[int], maj_k: list[int], seed: int) -> tuple[dict, list[dict]]:
    """The figures of n sampled completions per problem: pass@1 estimated from them (the mean correctness of
    the samples), unbiased pass@k for each k of `pass_k`, maj@k (the majority vote of the parsed answers of
    each problem's first k samples, stats.majority_vote) for each k of `maj_k`, each with a bootstrap 95%
    interval over problems seeded with `seed`; and what each problem's row in eval_samples.jsonl adds."""
    n = len(drawn[0][1]) if drawn else 0
    per_problem: dict[str, list[float]] = {"sampled_pass_at_1": [sum(c) / n for _, c in drawn]}
    for k in sorted(set(pass_k)):
        per_problem[f"pass@{k}"] = [pass_at_k(n, sum(c), k) for _, c in drawn]
    rows = [{"sampled_correct": sum(c), "sampled_predicted": list(p), "maj_at_k": {}} for p, c in drawn]
    for k in sorted(set(maj_k)):
        hits = []
        for ex, (predicted, _), row in zip(examples, drawn, rows):
            answer, votes = majority_vote(predicted[:k])
            right = rewards.answers_match(answer, str(ex["answer"]))
            row["maj_at_k"][str(k)] = {"answer": answer, "votes": votes, "correct": right}
            hits.append(float(right))
        per_problem[f"maj@{k}"] = hits
    if not maj_k:
        for row in rows:
            del row["maj_at_k"]

    def figure(values: list[float]) -> tuple[float, list[float]]:
        return (sum(values) / len(values) if values else 0.0), list(bootstrap_interval(values, seed))

    metrics: dict = {}
    metrics["sampled_pass_at_1"], metrics["sampled_pass_at_1_ci95"] = figure(per_problem["sampled_pass_at_1"])
    for name, key in (("pass", "pass_at_k"), ("maj", "maj_at_k")):
        ks = [int(k.split("@")[1]) for k in per_problem if k.startswith(f"{name}@")]
        if ks:
            pairs = {str(k): figure(per_problem[f"{name}@{k}"]) for k in ks}
            metrics[key] = {k: v for k, (v, _) in pairs.items()}
            metrics[f"{key}_ci95"] = {k: ci for k, (_, ci) in pairs.items()}
    metrics["bootstrap"] = {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "over": "problems"}
    return metrics, rows


def evaluate(model, tokenizer, examples: list[dict], *, system_prompt: str, max_new_tokens: int, batch_size: int = 8,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             desc: str = "eval", pass_k: list[int] | tuple = (), maj_k: list[int] | tuple = (),
             num_samples: int | None = None, judge=None, decode: str = "auto",
             engine_cache_mb: float | None = None) -> tuple[dict, list[dict]]:
    """Generate for every problem and score against its ground truth (a prompts stage's: by `judge`, its eval
    reward); with `pass_k` or `maj_k`, also sample `num_samples` completions per problem (default: the largest k) at
    `temperature` and report pass@1 estimated from them, pass@k and maj@k for each k, with bootstrap intervals
    (sampled_metrics; maj@k votes on the parsed numbers against the `answer` column). `decode`: eval.decode, the
    path of the greedy (or do_sample) completions (decode_path); the pass@k and maj@k samples use generate.
    `engine_cache_mb`: eval.engine_cache_mb, the engine path's KV cache per batch (None: `batch_size` rows)."""
    prompts = [prompt_messages(ex, system_prompt) for ex in examples]
    path = decode_path(model, decode, do_sample)
    texts, lengths, seconds, positions = generate_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                                   batch_size=batch_size, do_sample=do_sample,
                                                   temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                                   desc=desc, decode=path, engine_cache_mb=engine_cache_mb)
    metrics, samples = score(examples, texts, lengths, judge, prompts)
    metrics.update({
        "generation_s": seconds,
        # completion tokens (up to EOS) per second: the useful output rate
        "tokens_per_s": sum(lengths) / seconds if seconds > 0 else None,
        # every decoded position per second, padding after EOS included: the raw speed of the model
        "decode_tokens_per_s": positions / seconds if seconds > 0 else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "model_size_mb": round(model_size_mb(model), 1),
        "decoding": "sampled" if do_sample else "greedy",
        "decoded_by": path,  # engine (evaluation/fast_decode.py) or generate
        # problems asking for different computations (generated levels' canonical key; GSM8K: the question)
        "distinct": len({ex.get("key") or ex["question"] for ex in examples}),
    })
    if pass_k or maj_k:
        n = num_samples or max([*pass_k, *maj_k])
        drawn = sample_answers(model, tokenizer, examples, prompts, num_samples=n, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, temperature=temperature, seed=seed,
                               desc=f"{desc} {'pass@k' if pass_k else 'maj@k'}", top_k=top_k, top_p=top_p,
                               judge=judge)
        figures, rows = sampled_metrics(examples, drawn, pass_k=list(pass_k), maj_k=list(maj_k), seed=seed)
        metrics.update(figures)
        metrics["pass_samples"] = n
        metrics["pass_temperature"] = temperature
        metrics["pass_top_k"], metrics["pass_top_p"] = top_k, top_p
        for row, extra in zip(samples, rows):
            row.update(extra)
    return metrics, samples
