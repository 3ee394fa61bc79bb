"""The recipe's plan, chosen from the machine, the target's shape, the data and the time asked for.

Pure functions over numbers (no torch, no files): `make_plan` returns a Plan whose every number
carries the reason it was chosen, and an estimated time per stage. What fits in memory (feature cache,
rows per step, regeneration rows, eval batch) follows recipe/memory.py's rules; the times:

- regeneration time: the estimate is the data's turns · 136 generated tokens at the whole-stage rate
  measured on the mixture (44.6K tok/s, an 80 GiB H100 at 1,024 rows with row attention; an H200 at 2,048 rows
  is planned at that rate ÷ 0.83, the two cards' ratio measured before row attention), times
  recipe/regen_time.py's ratio for another target or other rows; the stage's time cap is twice that (at
  most 1 h, or 35 % of --hours): it ends when every prompt is answered.
- step time: the measured B = 8 step (H200: 6,000 steps of 8 · 4,096 tokens in 385 s; H100 0.92 of its
  rate), of which 36 % grows linearly with the block tokens (drafter forward and backward, LM head and loss: 32.7
  of 91.4 ms in the profiled H200 step, benchmarks/results/bench-step-smollm2-breakdown_h200_2026-12-02.json);
  B = 16 at 512 anchors doubles those tokens: 1.36 × the step. Another target's step is that step times
  recipe/step_time.py's ratio (FLOPs per token at a rate that grows with the width, and its cache's share).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from dflash_trainer.data.mixture.spec import MAX_WORKERS
from dflash_trainer.evaluation.settings import DEFAULT_MAX_PROMPT_TOKENS
from dflash_trainer.recipe.machine import mixture_workers
from dflash_trainer.recipe.memory import (GIB, TargetShape, cache_gib, eval_batch, eval_dtype, feature_row_bytes, regen_rows,
                                          step_rows)
from dflash_trainer.recipe.regen_time import regen_rate_ratio
from dflash_trainer.recipe.step_time import is_reference, step_time_ratio
from dflash_trainer.training.schedule import MAX_EPOCHS_WITHOUT_WARNING, rows_text

ANSWER_TOKENS_PER_TURN = 136  # tokens SmolLM2 wrote a user turn regenerating the mixture (16.05M / 118,180 turns)
TEMPLATE_TOKENS_PER_TURN = 10  # chat-template tokens a user turn adds (role markers of the turn and its answer)
MIN_DEFAULT_STEPS = 50  # the fewest steps a plan chooses for small data (its warmup is 4 % of them)
PLAN_PASSES = 9  # small data's default steps: 9 passes over its rows, under the train stage's warning at 10 for the
# rows estimate's error (the measured recipe's 6,000 steps are 8.2 passes over the mixture and held their τ)
EVAL_PROMPT_TOKENS = DEFAULT_MAX_PROMPT_TOKENS  # the longest prompt an eval turn holds (longer turns are skipped)
H200_TRAIN_TOKENS_PER_S = 511_000  # SmolLM2 drafter steps at B = 8: 6,000 × 8 × 4096 tokens in 385 s (H200)
H100_TRAIN_SPEED = 0.92  # the same steps' loop on an 80 GiB H100 (60 GiB cache): 420.2 s against 385.3 (2026-12-06)
H100_REGEN_SPEED = 0.83  # the whole mixture's regeneration there at 1,024 rows: 564 s with its load, against 467 s
# on an H200 at 2,048 rows (both before row attention, 2026-12-06): the H200's rate is planned as the H100's ÷ this
BLOCK_TOKEN_SHARE = 0.36  # share of the measured B = 8 step that grows with the block tokens (module docstring)
BLOCK_SIZE = 16  # the recipe's drafter block size B (the paper's); B = 8 measured τ 3.35 MT-Bench / 3.54 HumanEval
NUM_ANCHORS = 512  # anchors per row
H100_REGEN_TOKENS_PER_S = 44_600  # SmolLM2 regenerating the whole mixture, generated tok/s over the stage with its
# target load: 15.94M tokens in 357.6 s, 1,024 rows, row attention (80 GiB H100, 2026-12-07,
# benchmarks/results/recipe-smollm2-cmd_h100_2026-12-07b.json; 34.4K on an H200 before row attention)
H200_REGEN_ROWS, H100_REGEN_ROWS = 2048, 1024  # the rows of those two measured stages
H200_CLASS_GIB = 120  # free memory from which a card is taken to be H200-class (the measured rates' card)
REGEN_BUDGET_FACTOR = 2.0  # the regeneration's time cap is this many times its estimate (it ends when the data does)
REGEN_SHARE_OF_HOURS = 0.35  # with --hours: the regeneration's share of the time left after the fixed stages
TRAIN_START_S = 30.0  # the train stage's target load and compilation (measured 11.5 s on the H200 run above,
# 396.5 s of stage for 385 s of steps; 30 s leaves room for a cold compile cache)
EVAL_RUN_S = 160.0  # one drafter's eval on the three suites (fp32, batch 256, target loads included): 155 s on the
# 2026-12-07 H100 recipe run (the eval stage less its speedup table; about 48, 29 and 76 s by the files' times)
SPEEDUP_RUN_S = 170.0  # the drafter's speedup table (batch 1 … 256 on MT-Bench first turns, bf16): 147 s on that
# run, 83 s of it decoding (70 s at batch 1 and 4: plain 486 tok/s at batch 1, which no card speeds up much);
# since then batch 64 and 256 stream 320 and 1,040 rows instead of 128 and 256 (evaluation/speedup.py): ~20 s more
HELDOUT_PROMPTS, HELDOUT_TURNS = 256, 2  # the held-out ShareGPT suite on a GPU: its first 256 conversations, 2 turns
# the packaged mixture on 2 cores: 96 s with its math generator in 2 processes and the code source's parsing
# in one (2026-12-06: math 53 s, code 33 s); 72 s with both in 2 (2026-12-07: math 44 s, code 18 s; ShareGPT,
# chitchat and the eval-leak check 20 s in one process). With margin: 150 s at 2 processes, 45 s at 16
MIXTURE_ONE_PROCESS_S, MIXTURE_SPLIT_S = 30.0, 240.0


def mixture_seconds(workers: int, build_s: Optional[tuple[float, float]] = None) -> float:
    """A mixture's estimated seconds with `workers` processes for its math generator and code parsing
    (recipe/machine.py `mixture_workers`): `build_s` (DataSize.build_s), by default the packaged mixture's
    (150 s at 2)."""
    one, split = build_s or (MIXTURE_ONE_PROCESS_S, MIXTURE_SPLIT_S)
    return one + split / max(1, workers)


@dataclass(frozen=True)
class DataSize:
    """The chat data's size: conversations, user turns, tokens of prompts + answers (None = unknown:
    estimated from conversations), and whether those counts were estimated."""

    conversations: int
    turns: int
    tokens: Optional[int] = None
    estimated: bool = False
    # a mixture's build: (seconds in one process, CPU-seconds its math and code sources split over processes);
    # None = the packaged mixture's (MIXTURE_ONE_PROCESS_S, MIXTURE_SPLIT_S)
    build_s: Optional[tuple[float, float]] = None

    def times(self, samples: int) -> "DataSize":
        """The data after a regeneration writes `samples` answers of each conversation: every count × samples
        (each sample is a whole conversation, its prompt included)."""
        return DataSize(self.conversations * samples, self.turns * samples,
                        None if self.tokens is None else self.tokens * samples, self.estimated, self.build_s)

    def total_tokens(self, answer_tokens: int) -> int:
        """Tokens after regeneration: the known count, else turns · (answer_tokens + 70 prompt tokens)."""
        return self.tokens if self.tokens is not None else self.turns * (answer_tokens + 70)


@dataclass
class Plan:
    """What the recipe runs with. Sizes: GiB, rows, steps; times: seconds. `reasons` maps each
    number's name to the sentence that chose it; `stage_seconds` holds the estimate per stage."""

    device: str
    gpu_memory_gib: Optional[float]
    seq_len: int
    feature_cache_gib: float
    regen_batch_rows: int
    regen_max_seconds: float
    regen_max_conversations: Optional[int]
    regen_max_new_tokens: int
    regen_max_prompt_tokens: int
    eval_batch: int
    eval_max_prompts: Optional[int]
    eval_max_new_tokens: int
    rows_per_step: int
    steps: int
    save_every: int
    train_sets: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    eval_dtype: str = "auto"
    heldout_max_prompts: Optional[int] = None
    heldout_max_turns: Optional[int] = None
    block_size: int = 8
    warnings: list[str] = field(default_factory=list)  # what this card or budget gives up against the measured recipe

    def as_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data."""
        return asdict(self)

    def total_seconds(self) -> float:
        """The estimated time of the whole recipe (s)."""
        return float(sum(self.stage_seconds.values()))


def _h200_class(free_gib: float) -> bool:
    """Whether a card with `free_gib` free is planned at the H200's measured rates (else at the H100's)."""
    return free_gib >= H200_CLASS_GIB


def _train_speed(free_gib: float) -> float:
    """The drafter step's throughput relative to the H200 its constant was measured on; a smaller card is
    taken to be H100-class (measured on an 80 GiB H100, 2026-12-06)."""
    return 1.0 if _h200_class(free_gib) else H100_TRAIN_SPEED


def _regen_tok_s(free_gib: float) -> float:
    """SmolLM2's whole-stage regeneration rate (generated tok/s) on the card's class at that class's measured
    rows: the H100's measured rate, or for an H200-class card that rate ÷ H100_REGEN_SPEED."""
    return H100_REGEN_TOKENS_PER_S / H100_REGEN_SPEED if _h200_class(free_gib) else H100_REGEN_TOKENS_PER_S


def make_plan(free_gib: Optional[float], shape: TargetShape, data: DataSize, *, hours: Optional[float] = None,
              steps: Optional[int] = None, control: bool = False, seq_len: Optional[int] = None,
              mixture_done: bool = False, block_size: Optional[int] = None, num_anchors: Optional[int] = None,
              samples: int = 1) -> Plan:
    """The plan for a card with `free_gib` GiB free (None = CPU). `steps` fixes the training steps; else
    `hours` is the whole recipe's time (regeneration gets at most 35 % of what the fixed stages leave,
    training the rest); neither = the measured recipe's 6,000 steps (GPU; fewer for small data: PLAN_PASSES
    passes over its rows, at least MIN_DEFAULT_STEPS) or a 40-step tiny plan (CPU).
    `mixture_done`: no mixture stage to budget (--data given). `block_size` / `num_anchors`: the user's
    drafter.block_size / loss.num_anchors (None: BLOCK_SIZE, NUM_ANCHORS on a GPU); they size the step's
    memory and time. `samples`: answers the regeneration writes per conversation (--regen-samples): the
    regeneration, the rows and the cache are sized for that many copies of the data. Raises ValueError for
    hours/steps ≤ 0 or a card too small for one drafter step of one row."""
    if hours is not None and hours <= 0 or steps is not None and steps <= 0:
        raise ValueError("--hours and --steps must be > 0")
    if free_gib is None:
        return _cpu_plan(shape, data, hours, steps, control, seq_len or 512, mixture_done, block_size or 8, samples)
    data = data.times(samples)
    seq = seq_len or 4096
    reasons: dict[str, str] = {"seq_len": "--set data.seq_len" if seq_len else "the measured recipe's rows of 4,096 tokens",
                               "regen_max_conversations": "every conversation of the data"}
    B, anchors = block_size or BLOCK_SIZE, num_anchors or NUM_ANCHORS
    block_tokens = B * anchors
    reasons["block_size"] = ("--set drafter.block_size" if block_size else
                             f"the paper's B = {BLOCK_SIZE}; {anchors} anchors a row: {block_tokens:,} block tokens")
    rows_per_step, reasons["rows_per_step"] = step_rows(free_gib, shape, seq, block_tokens)
    prompt, new = 1536, 512
    total = data.total_tokens(new)
    rows = max(1, math.ceil(total * 0.98 / seq))
    cache, reasons["feature_cache_gib"] = cache_gib(free_gib, shape, seq, rows_per_step, rows, block_tokens)
    regen, reasons["regen_batch_rows"] = regen_rows(free_gib, shape, prompt, new, data.conversations)
    if samples > 1:
        reasons["regen_max_conversations"] += f", {samples} sampled answers each (--regen-samples)"
    dtype, reasons["eval_dtype"] = eval_dtype(free_gib, shape)
    ev, reasons["eval_batch"] = eval_batch(free_gib, shape, EVAL_PROMPT_TOKENS, 256, dtype=dtype)
    # SmolLM2's whole-stage rate measured on this card's class at its rows there, scaled to this target and its
    # rows by recipe/regen_time.py's fit of the decode step
    measured_rows = H200_REGEN_ROWS if _h200_class(free_gib) else H100_REGEN_ROWS
    regen_tok_s = (_regen_tok_s(free_gib)
                   * regen_rate_ratio(shape, regen, SMOLLM2_135M, measured_rows))
    regen_need = data.turns * ANSWER_TOKENS_PER_TURN / regen_tok_s
    if not is_reference(shape, SMOLLM2_135M):
        unmeasured = (f"; {regen_tok_s:,.0f} tok/s is SmolLM2's measured rate scaled to this target's shape by a "
                      f"fit of random-weight targets' decode steps (recipe/regen_time.py), not measured on this target")
    elif regen != measured_rows:
        unmeasured = (f"; SmolLM2's rate was measured at {measured_rows:,} rows, scaled to {regen:,} by a fit of "
                      f"decode steps (recipe/regen_time.py, fitted on 128–2,048 rows)")
    else:
        unmeasured = ""
    train_tok_s = H200_TRAIN_TOKENS_PER_S * _train_speed(free_gib)
    cached = cache / (rows * feature_row_bytes(shape, seq) / GIB)  # share of the rows the feature cache holds
    step_s = (rows_per_step * seq / train_tok_s * (1 + BLOCK_TOKEN_SHARE * (block_tokens / seq - 1))
              * step_time_ratio(shape, SMOLLM2_135M, block_tokens / seq, cached))  # another target: recipe/step_time.py
    # measured: the mixture 97–134 s on 2 cores (mixture_seconds); prepare 37–42 s for 24.6M tokens on 16 cores; the regeneration's
    # whole-stage rate includes its target load, the train stage adds TRAIN_START_S to its steps
    # --hours budgets the mixture at its 2-core time on any machine: the steps it gives are part of the train
    # stage's key, which must not change with the CPUs of the host a run resumes on (the time shown is this host's)
    fixed = {"mixture": 0.0 if mixture_done else mixture_seconds(2, data.build_s), "prepare": 20.0 + total / 500_000,
             "eval": EVAL_RUN_S * (2 if control else 1) + SPEEDUP_RUN_S, "export": 30.0, "report": 5.0}
    per_pass = math.ceil(rows / rows_per_step)  # steps a pass over the rows takes (the train stage's count)
    by_hours = steps is None and hours is not None
    if by_hours:
        budget = hours * 3600 - sum(fixed.values()) - TRAIN_START_S * (2 if control else 1)
        regen_s = max(60.0, min(regen_need, REGEN_SHARE_OF_HOURS * budget))
        regen_cap = regen_s
        steps = max(10, int((budget - regen_s) / step_s / (2 if control else 1)))
        reasons["steps"] = f"{hours:g} h less the fixed stages and regeneration, at {step_s * 1e3:.0f} ms a step"
        reasons["regen_max_seconds"] = (f"the whole data's estimated {regen_need:.0f} s, at most "
                                        f"{REGEN_SHARE_OF_HOURS:.0%} of what {hours:g} h leave after the fixed stages"
                                        f"{unmeasured}")
    else:
        regen_s = max(60.0, min(regen_need, 3600.0))
        regen_cap = max(120.0, min(REGEN_BUDGET_FACTOR * regen_need, 3600.0))
        epochs = 6000 / per_pass
        most = max(MIN_DEFAULT_STEPS, PLAN_PASSES * per_pass)
        if steps:
            reasons["steps"] = "--steps"
        elif most < 6000 and most == MIN_DEFAULT_STEPS:
            reasons["steps"] = (f"the plan's least, {MIN_DEFAULT_STEPS} steps: {most / per_pass:,.1f} passes over the "
                                f"data's {rows_text(rows)} (the measured recipe's 6,000 steps would be {epochs:,.1f} "
                                f"passes); more data trains longer")
            steps = most
        elif most < 6000:  # small data: the measured recipe's steps would learn its rows by heart
            reasons["steps"] = (f"{PLAN_PASSES} passes over the data's {rows_text(rows)} at {rows_text(rows_per_step)} "
                                f"a step (the measured recipe's 6,000 steps would be {epochs:,.1f} passes); more data "
                                f"trains longer")
            steps = most
        else:
            reasons["steps"] = f"the measured recipe's 6,000 steps ({epochs:.1f} epochs of this data)"
            if rows_per_step < 8:
                reasons["steps"] += (f"; at {rows_text(rows_per_step)} a step they see "
                                     f"{rows_per_step}/8 of its tokens "
                                     f"(--steps {6000 * 8 // rows_per_step} sees as many)")
        steps = steps or 6000
        reasons["regen_max_seconds"] = (f"a cap, not a target (the stage ends when every prompt is answered): "
                                        f"{REGEN_BUDGET_FACTOR:g} × the whole data's estimated {regen_need:.0f} s "
                                        f"({regen_tok_s:,.0f} tok/s), at least 2 min, at most 1 h{unmeasured}")
    sets = [f"data.seq_len={seq}", f"target.feature_cache_gib={cache:g}", f"optim.rows_per_step={rows_per_step}",
            f"optim.max_steps={steps}", f"runtime.save_every={max(1, steps // 12)}", "runtime.keep_last=1",
            "drafter.num_layers=5",
            f"drafter.block_size={B}", "drafter.layer_types=full", f"drafter.num_target_features={shape.k}",
            f"loss.num_anchors={anchors}", "loss.label_source=target", "loss.position_weights=dpace", "optim.lr=6.0e-4",
            "optim.warmup_ratio=0.04", "optim.grad_clip=1.0", "experimental.loss_impl=fused", "runtime.device=cuda"]
    warnings = []
    passes = steps / per_pass
    if passes > MAX_EPOCHS_WITHOUT_WARNING:  # the train stage's own small-data rule, said before any stage runs
        fix = ("fewer --steps" if reasons["steps"] == "--steps" else "fewer --hours" if by_hours else
               f"--steps below the plan's least, {MIN_DEFAULT_STEPS}")
        warnings.append(f"{steps:,} steps ({rows_text(min(rows_per_step, rows))} each) are about {passes:,.1f} passes over the "
                        f"data's {rows_text(rows)} (more than {MAX_EPOCHS_WITHOUT_WARNING}): the drafter will learn "
                        f"them by heart; give more data, or {fix}")
    if regen_cap < regen_need:
        share = regen_cap / regen_need
        reasons["regen_max_conversations"] = reasons["regen_max_conversations"].replace(
            "every conversation of the data", f"the conversations its {regen_cap:.0f} s cap reaches: about "
                                              f"{share:.0%} of the data at the estimated rate")
        more = ["a larger card", *(["more --hours"] if by_hours else []),
                "a smaller --data" if mixture_done else "a smaller --spec mixture"]
        warnings.append(f"the regeneration would need about {regen_need / 60:.0f} min for the whole data; its "
                        f"{regen_cap / 60:.0f} min cap answers about {share:.0%} of the conversations "
                        f"({', '.join(more[:-1])} or {more[-1]} answers more){unmeasured}")
    train_s = steps * step_s + TRAIN_START_S
    workers = mixture_workers()
    if not mixture_done:
        one, split = data.build_s or (MIXTURE_ONE_PROCESS_S, MIXTURE_SPLIT_S)
        reasons["time: mixture"] = (f"estimate: {workers} processes (this machine's CPUs, at most {MAX_WORKERS}): "
                                    f"{one:.0f} s + {split:.0f} s ÷ {workers}")
    if not is_reference(shape, SMOLLM2_135M):
        reasons["time: eval"] = (f"SmolLM2's measured eval ({EVAL_RUN_S:.0f} s for the suites, {SPEEDUP_RUN_S:.0f} s "
                                 f"for the speedup table); another target's differs, by an amount not modelled")
    if _h200_class(free_gib):
        reasons["time: regenerate"] = (f"estimate at the rate measured on an H100 ÷ {H100_REGEN_SPEED} (the two "
                                       f"cards' ratio, measured before row attention)")
        reasons["time: train"] = "estimate at the rate measured on an H200"
    else:
        card = f"H100 (every card under {H200_CLASS_GIB} GiB is planned as one)"
        for stage in ("regenerate", "train"):
            reasons[f"time: {stage}"] = f"estimate at the rate measured on an {card}"
    seconds = {"mixture": 0.0 if mixture_done else mixture_seconds(workers, data.build_s), "regenerate": regen_s, "prepare": fixed["prepare"], "train": train_s,
               **({"control": train_s} if control else {}), "eval": fixed["eval"], "export": fixed["export"],
               "report": fixed["report"]}
    reasons["eval_max_prompts"] = (f"whole MT-Bench and HumanEval on a GPU, 256 new tokens (the measured recipe); "
                                   f"held-out ShareGPT: its first {HELDOUT_PROMPTS} conversations, {HELDOUT_TURNS} turns")
    return Plan("cuda", free_gib, seq, cache, regen, round(regen_cap), None, new, prompt, ev, None, 256, rows_per_step,
                steps, max(1, steps // 12), sets, reasons, seconds, eval_dtype=dtype,
                heldout_max_prompts=HELDOUT_PROMPTS, heldout_max_turns=HELDOUT_TURNS, block_size=B, warnings=warnings)


def _cpu_plan(shape: TargetShape, data: DataSize, hours: Optional[float], steps: Optional[int], control: bool,
              seq: int, mixture_done: bool = False, block_size: int = 8, samples: int = 1) -> Plan:
    """A tiny plan for a CPU: 200 answered conversations (input conversations × `samples`), 40 steps (or what
    --steps / --hours give), 1 prompt per suite."""
    scale = shape.params / SMOLLM2_135M.params  # the CPU rates below are SmolLM2's
    step_s = 1.5 * max(scale, 0.01)  # `make train`'s SmolLM2 steps on 2 cores: ~1.5 s at seq_len 512
    convs = min(max(1, 200 // samples), data.conversations)  # regenerate's --max-conversations counts inputs
    regen_s = convs * samples * 1.5 * 128 / (150 / max(scale, 0.01))  # ~150 generated tok/s for SmolLM2 on 2 cores
    reasons = {"device": "no GPU: a tiny plan that shows the whole path, not a useful drafter",
               "regen_max_conversations": f"{convs} conversations (CPU)" + (f", {samples} sampled answers each"
                                                                            if samples > 1 else ""),
               "regen_batch_rows": "8 rows (regenerate's CPU default)",
               "eval_batch": "batch 1 (latency-bound decoding on CPU)",
               "eval_max_prompts": "1 prompt, 1 turn, 64 new tokens per suite (CPU)",
               "feature_cache_gib": "off on CPU (the target runs on each row each epoch)",
               "rows_per_step": "1 row a step",
               "seq_len": "--set data.seq_len" if seq != 512 else "rows of 512 tokens (CPU tiny plan)",
               "regen_max_seconds": "twice the estimate for the conversations (CPU)",
               "eval_dtype": "auto: float32, the CPU default",
               "block_size": "B = 8 (CPU tiny plan)" if block_size == 8 else "--set drafter.block_size"}
    if steps is None and hours is not None:
        steps = max(5, int((hours * 3600 - regen_s - 300) / step_s))
        reasons["steps"] = f"{hours:g} h less regeneration and ~5 min of fixed stages, at {step_s:.1f} s a step"
    else:
        reasons["steps"] = "--steps" if steps else "40 steps (CPU tiny plan)"
        steps = steps or 40
    sets = [f"data.seq_len={seq}", f"optim.max_steps={steps}", f"runtime.save_every={max(1, steps // 4)}", "runtime.keep_last=1",
            "drafter.num_layers=3", f"drafter.block_size={block_size}", "runtime.device=cpu"]
    train_s = steps * step_s + 30
    # measured on 2 cores (2026-12-06, a clean clone): mixture 78 s, eval 42 s for the three suites, export 6 s
    mixture_s = mixture_seconds(2, data.build_s) if data.build_s else 90.0  # the packaged one: 78 s measured
    seconds = {"mixture": 0.0 if mixture_done else mixture_s, "regenerate": regen_s + 20, "prepare": 10.0, "train": train_s,
               **({"control": train_s} if control else {}), "eval": 3 * 15.0 * (2 if control else 1) + 15.0, "export": 10.0,
               "report": 2.0}
    return Plan("cpu", None, seq, 0.0, 8, round(max(60.0, 2 * regen_s)), convs, 128, 512, 1, 1, 64, 1, steps,
                max(1, steps // 4), sets, reasons, seconds, block_size=block_size)


SMOLLM2_135M = TargetShape(hidden=576, layers=30, kv_heads=3, head_dim=64, vocab=49152, params=134.5e6, k=5)
# The packaged mixture's last full regeneration (H100, 2026-12-05): 67,605 records, 118,180 turns, 24.6M tokens
MIXTURE_SMOLLM2 = DataSize(conversations=67_605, turns=118_180, tokens=24_600_000, estimated=True)
# configs/mixture-smollm2-large.yaml's build (2026-12-07): 197,787 records, 255,050 user turns; tokens as
# recipe/inputs.py `data_size` estimates them from its prompts (not yet regenerated). Its build on 2 cores took
# 203 s (math 157 s and code 24 s in 2 processes; ShareGPT, chitchat, evals and the eval-leak check ~20 s):
# with margin 45 s + 480 s ÷ processes
MIXTURE_SMOLLM2_LARGE = DataSize(conversations=197_787, turns=255_050, tokens=55_003_504, estimated=True,
                                 build_s=(45.0, 480.0))
