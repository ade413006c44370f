"""`python scripts/fisher_agreement.py [--init-from RUN] [--stage basic] [--samples 32 128] [--seeds 1 2]`: do two
estimates of EWC's Fisher from different seeds agree? Issue 67 asks the Fisher to come from enough samples that they do.

For each sample count, the diagonal Fisher is estimated as a curriculum stage estimates it (training/ewc.estimate on
the stage's training prompts, shuffled by the seed, at the stage's completion length and sampling temperature) once
per seed, from the same model: the packaged default model, or `--init-from`'s model/ (a trained run). Printed and
written to fisher_agreement.json in --out (default outputs/fisher_agreement/<timestamp>): per sample count, the
Spearman rank correlation over parameters of each pair of seeds' estimates (training/fisher_scale.rank_correlation),
each estimate's raw mean and its seconds. Parameters as EWC covers them (embeddings left out, as by default).
`--page docs/results/<name>.md --machine <docs/machines.md entry>` also writes a results page: the command, commit,
date, machine and versions at its top, then the table."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger("fisher_agreement")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init-from", default=None, help="a run directory whose model/ the Fisher is taken at")
    parser.add_argument("--stage", default="basic", help="a conf/stage option: whose training prompts are sampled")
    parser.add_argument("--samples", type=int, nargs="+", default=[32, 128], help="ewc.fisher_samples to compare")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="at least two sampling seeds")
    parser.add_argument("--model", default="smollm2_135m", help="a conf/model option")
    parser.add_argument("--threads", default="2", help="cpu.threads")
    parser.add_argument("--out", default=None)
    parser.add_argument("--page", default=None, help="also write a results page (docs/results/<name>.md)")
    parser.add_argument("--machine", default=None, help="the machine's entry in docs/machines.md, for --page")
    args = parser.parse_args()
    if len(set(args.seeds)) < 2 or min(args.samples) < 1:
        parser.error("give at least two different --seeds and positive --samples")
    if args.init_from and not (Path(args.init_from) / "model" / "config.json").is_file():
        parser.error(f"--init-from {args.init_from} holds no model/ (a finished run's directory)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from grpo_exp.base import cpu
    from grpo_exp.config.compose import compose

    cfg = compose("train", [f"model={args.model}", f"stage={args.stage}", f"cpu.threads={args.threads}"])
    cpu.prepare_env(cfg.cpu)
    from grpo_exp.core import data, models
    from grpo_exp.training import ewc, fisher_scale

    cpu.apply(cfg.cpu)
    init = Path(args.init_from) / "model" if args.init_from else None
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0, init_from=init)
    examples = data.stage_split(cfg.stage, "train", cfg.train.seed)
    out = Path(args.out or f"outputs/fisher_agreement/{datetime.now(timezone.utc):%Y-%m-%d_%H-%M-%S}")
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "init_from": args.init_from, "stage": args.stage, "seeds": args.seeds,
              "max_new_tokens": int(cfg.train.max_completion_length), "temperature": float(cfg.train.temperature),
              "by_samples": []}
    for samples in args.samples:
        estimates, row = {}, {"samples": samples, "raw_mean": {}, "seconds": {}}
        for seed in args.seeds:
            prompts = [data.prompt_messages(ex, cfg.reward.system_prompt) for ex in examples]
            random.Random(seed).shuffle(prompts)
            t0 = time.perf_counter()
            estimates[seed] = ewc.estimate(model, tokenizer, prompts, samples=samples,
                                           max_new_tokens=result["max_new_tokens"], temperature=result["temperature"],
                                           batch_size=8, seed=seed, include_embeddings=False)
            row["seconds"][seed] = round(time.perf_counter() - t0, 1)
            row["raw_mean"][seed] = fisher_scale.mean_value(estimates[seed])
        row["spearman"] = {f"{a}-{b}": fisher_scale.rank_correlation(estimates[a], estimates[b])
                           for a, b in itertools.combinations(args.seeds, 2)}
        logger.info("%d samples: Spearman %s; raw means %s; seconds %s", samples,
                    ", ".join(f"{k} {v:.3f}" for k, v in row["spearman"].items()),
                    ", ".join(f"{v:.3g}" for v in row["raw_mean"].values()), row["seconds"])
        result["by_samples"].append(row)
        (out / "fisher_agreement.json").write_text(json.dumps(result, indent=1))
    logger.info("wrote %s", out / "fisher_agreement.json")
    if args.page:
        write_page(Path(args.page), result, args.machine)
        logger.info("wrote %s", args.page)


def write_page(page: Path, result: dict, machine: str | None) -> None:
    from grpo_exp.analysis import provenance

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    pairs = list(result["by_samples"][0]["spearman"])
    lines = [f"# Results: {page.stem}", "", "<!-- Written by scripts/fisher_agreement.py; rerun its command. -->", "",
             f"- **Made by:** `{command}`", provenance.commit_line("estimates", [], "made by this command"),
             provenance.date_line(None), f"- **Machine:** {provenance.machine_line(machine, tool='the script')}",
             provenance.versions_line("the script", [], ""), "",
             f"The diagonal Fisher of `{result['model']}`" + (f" trained in `{result['init_from']}`"
                                                               if result["init_from"] else "")
             + f" on `{result['stage']}`'s training prompts ({result['max_new_tokens']} new tokens, temperature "
             f"{result['temperature']:g}), estimated once per sampling seed at each sample count, as a stage's EWC "
             "estimates it; Spearman's rank correlation over the parameters EWC covers (1: both estimates order "
             "the parameters' importance alike).", "",
             "| samples | " + " | ".join(f"Spearman, seeds {p}" for p in pairs) + " | raw mean per seed | seconds per "
             "estimate |", "|---|" + "---|" * (len(pairs) + 2)]
    for row in result["by_samples"]:
        lines.append(f"| {row['samples']} | " + " | ".join(f"{row['spearman'][p]:.3f}" for p in pairs)
                     + " | " + ", ".join(f"{v:.3g}" for v in row["raw_mean"].values())
                     + " | " + ", ".join(f"{v:g}" for v in row["seconds"].values()) + " |")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
