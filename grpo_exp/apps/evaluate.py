"""`python -m grpo_exp.evaluate checkpoint=<run dir> eval.sets=[basic,gsm8k] eval.limit=50`: ground-truth
accuracy of one model on held-out problems. A thin Hydra main over grpo_exp.evaluation.run."""

from __future__ import annotations

from grpo_exp.apps.task import run_task


def evaluate_task(cfg) -> dict:
    from grpo_exp.evaluation.run import run

    return run(cfg)


def check(cfg) -> None:
    from grpo_exp.evaluation.run import check as check_evaluation

    check_evaluation(cfg)


def mean_accuracy(report: dict) -> float | None:
    accuracies = [m["accuracy"] for m in report["sets"].values()]
    return sum(accuracies) / len(accuracies) if accuracies else None


def main() -> None:
    run_task("evaluate", evaluate_task, check, objective=mean_accuracy)


if __name__ == "__main__":
    main()
