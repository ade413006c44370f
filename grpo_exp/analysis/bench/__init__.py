"""Benchmark grpo-exp's training path against a plain TRL GRPOTrainer on the same prompts and settings.

    grpo-bench                                   # default model, 1 warm-up + 5 measured steps each
    grpo-bench --profile                         # + where the time goes inside a step, and where RSS peaks
    grpo-bench --override train=fast             # measure grpo-exp with other config overrides
    grpo-bench --candidate fast=train=fast --candidate static=+train.extra.cache_implementation=static
    grpo-bench --candidate passive=cpu.omp_wait_policy=passive --candidate trl_passive=kind=trl,env.OMP_WAIT_POLICY=PASSIVE
    grpo-bench --reward-curve-steps 30           # + reward per step of both variants (bench.json, PNG)
    grpo-bench --baseline fp32 --baseline trl-defaults --candidate engine=speed.generation=engine
    grpo-bench --candidate before=speed.exact_shortcuts=false   # what the exact shortcuts buy
    grpo-bench --candidate trl_path=speed=trl                    # grpo-exp with plain TRL's path
    grpo-bench --rounds 3                        # each variant 3 times, in alternating order: ratios per round
    grpo-bench --matrix --steps 2 --warmup 1 --fixed-length     # every point of --models x --lengths x --groups

Variants, each in its own subprocess (so its peak RSS, the child's ru_maxrss, is its own):
  baseline  a plain `trl.GRPOTrainer` built from `trl.GRPOConfig` with TRL's defaults as the older CPU tools run
            it: fp32 (bf16=False; on the CPU, or the GPU where there is one), TRL's default gradient checkpointing left on; the GRPO settings
            (lr and its schedule, num_generations, batch and generation rounds, max_completion_length, seed, beta, loss_type, sampling,
            clipping) copied from the composed grpo-exp config, so only the performance settings differ.
  trl-defaults  (--baseline trl-defaults) a plain `trl.GRPOTrainer` with TRL's own precision defaults, as a TRL user
            gets it today: bf16 on (GRPOConfig's default), gradient checkpointing on; the same GRPO settings.
  grpo-exp  `grpo_exp.training.stage.prepare` + `grpo_exp.training.trainer.build_trainer` (what training runs) from conf/train.yaml composed with the same overrides (+ --override).
  <name>    each --candidate NAME=OVERRIDE[,OVERRIDE...]: grpo-exp with those extra overrides (env.VAR=VALUE:
            an environment variable of that child; kind=trl: a plain-TRL variant, e.g. with another env).

grpo-exp's child applies cpu.omp_wait_policy before torch loads and cpu.malloc before the model loads, as the
entrypoint does (defaults: OpenMP's own policy; freed memory retained for reuse); the baseline child runs with
OpenMP's and glibc's defaults as a plain TRL script does (kind=trl,env.MALLOC_MMAP_MAX_=0,... gives it retain's).

Completion tokens of a step = TRL's `completions/mean_length` x the completions generated in that step (the
per-step batch, or the whole generation batch on the steps that generate when steps_per_generation > 1). Rates
are sums over the measured steps (after the warm-up); with steps_per_generation = k the measured window is
rounded up to whole multiples of k steps so it holds exactly one generation per k steps.

The floor: before the variants run, the parent measures the machine's GEMM peak (fp32 and bf16, best of a few
1536^3 products) and its memory read bandwidth (a 256 MB sum) with the variants' thread count, in a few seconds.
Each variant's floor per optimizer step is then
    6 N (completion tokens + distinct prompt tokens) / peak                 scoring forward + backward
  + [2 N (distinct prompt tokens) / peak                                    prefill, once per prompt
     + decoding steps x max(W / bandwidth, 2 N B / peak)] / steps_per_generation
with N the parameters that multiply (the input embedding is a lookup; a tied LM head counts once), W = N at the
machine's fastest GEMM dtype (2 bytes for bf16, else 4), B the rows of a generation round, decoding steps the
longest completion of the round (TRL's completions/max_length), and peak the fastest GEMM dtype's. Attention, norms
and the optimizer are left out, so the floor is a lower bound; each variant's mean step time is printed as a
multiple of it.

--rounds N runs the whole set N times, the order reversed every other round (A B C, C B A, A B C), so a slow
phase of a shared or virtual machine falls on neighbours rather than on one variant. A variant's figures pool
its rounds' measured steps (peak RSS: its highest round); bench.md's Rounds table gives each round's tokens/s and
each variant's ratio to every baseline in the same round, with their median, lowest and highest.

Each step also counts the child's minor page faults (pages the kernel mapped in, zero-filled when new: memory the
allocator gave back and took again; cpu.malloc), reported per measured step.

Writes bench.json, bench.md (and reward_curve.png) into --out (default outputs/bench/<timestamp>/); with
--page docs/results/<name>.md --machine NAME, a results page of them too (grpo-report <out> --page ... writes
it again).

--matrix runs one such bench per point of --models x --lengths x --groups (default smollm2_135m,gemma3_270m x
64,256 x 4,16): grpo-exp against plain TRL fp32 and TRL's bf16 defaults (the latter left out, with a line, where
bf16 is emulated), at the stage's beta, with --steps, --warmup, --rounds, --prompts-per-step, --threads,
--fixed-length, --override and the like passed to every point. Before anything loads it estimates each point's
peak memory from the model's config and refuses a point over the available memory (--no-memory-check runs it
anyway). Each point is a folder of --out (default outputs/bench/matrix/) with its own bench.json; a point measured
there already is kept, so the same command continues a stopped matrix. Writes matrix.json, matrix.csv, matrix.md
and matrix.png, and with --page a results page of them.
"""

# The docstring above is grpo-bench's --help. The modules: parent (the variants, their rounds and children,
# bench.json and bench.md), child (one variant's measuring process), floor (the machine's limits and each
# variant's floor), tables (the Markdown tables, the ratios and the reward plot), page (the results page), matrix
# (--matrix's points, their resume and matrix.json), memory (a point's peak-memory estimate), matrix_report
# (matrix.csv, .md, .png and its results page).
