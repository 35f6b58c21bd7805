"""Every guard rule by id: its default severity, what it stops and what to do instead.

This is the one place a rule's words live. The static rules (guard/rules/*.py) report
`Hit`s that name a rule id; `finding()` turns a hit into a `Finding` with the words from here.
docs/GUARD.md has one section per id, with the incident each rule comes from.

Adding a rule: add a `Rule` here, a check in one of guard/rules/*.py (a new module goes into
`guard.rules.CHECKS`), a section in docs/GUARD.md, and a planted cheat in tests/e2e/test_guard_static.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from flaloop.guard.findings import BLOCK, WARN, Finding


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str  # default; a hit may lower or raise it (e.g. shape-branch on a range is a warn)
    title: str
    why: str
    fix: str


_ALLOW = "if it is truly needed, record why: `flaloop audit OP --allow {id} --why \"...\"`"

RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("numeric-tf32", BLOCK, "fp32 math relaxed to TF32 or a lower matmul precision",
         "TF32 (10-bit mantissa) matmuls are several times faster than IEEE fp32 and still pass loose "
         "test tolerances, so the speedup comes from doing less precise math, not better code; a "
         "process-wide flag also changes every other op, the base's included.",
         "keep fp32 inputs at the base's precision; tune tiles, stages and warps instead"),
    Rule("numeric-narrow", BLOCK, "an fp32 accumulator or output narrowed to bf16/fp16 (or fp8)",
         "a literal low-precision cast or accumulator applies to every input dtype: fp32 callers get "
         "bf16-rounded results (and bf16 tests cannot tell), which is a precision change, not a speedup.",
         "cast to the dtype the caller asked for (`x.dtype`, `o.dtype.element_ty`), accumulate in fp32"),
    Rule("ref-call", BLOCK, "the op calls its naive reference, the test's reference, or test machinery",
         "an op that hands (some) inputs to the very reference the test compares against passes the "
         "gate by construction and is timed on a different code path than the one claimed.",
         "keep every shape on the op's own kernels; a slow path must be the op's own, and measured"),
    Rule("vendor-compute", BLOCK, "compute delegated to a library GEMM/attention where the base had kernels of its own",
         "swapping the kernel for torch.matmul / einsum / SDPA / cuBLAS benchmarks someone else's "
         "library, not an improvement of this op (and usually changes precision too).",
         "optimize the op's own kernels; if a library call really is the better design, say so "
         "in the PR and record the exception"),
    Rule("cache-memo", BLOCK, "module-level caches, memoisation, call counters or replayed graphs",
         "results or work keyed on tensor identity (data_ptr, id), kept in module state, or replayed "
         "from a captured graph skip the work in the timed calls (and warm-up detection times a "
         "different path than the tests run).",
         "compute every call from its inputs; keep launch metadata caches keyed on shapes and dtypes "
         "only, and only in the autotuner's own cache"),
    Rule("shape-branch", BLOCK, "a branch on a literal shape value the tests or the benchmark use",
         "a special case for exactly the tested or benchmarked shape makes the measured cell "
         "unrepresentative and can hide a path the tests never exercise.",
         "write shape-generic code; measured shape buckets belong in `flaloop dispatch`, one row per bucket"),
    Rule("concurrency", BLOCK, "new streams, threads, processes, forks or exit hooks",
         "work on a side stream or thread escapes the timing events of the caller's stream; a "
         "process or atexit hook can act after the measurement or on the harness itself.",
         "launch on the current stream, synchronously, from the calling thread"),
    Rule("timer-patch", BLOCK, "timers, synchronisation or checkers patched or shadowed",
         "replacing torch.cuda.Event.elapsed_time, synchronize, time.*, triton.testing, pytest or an "
         "assert_close changes what the harness measures or checks (on the H200 a wrapped "
         "elapsed_time read FASTER 1.25x).",
         "never touch the harness's tools; speed up the kernel"),
    Rule("lib-patch", WARN, "an attribute of an external library assigned",
         "global library settings change the behaviour of both sides and of the harness; not every "
         "one is a cheat, so this only warns.",
         "prefer per-call arguments to global settings; explain the setting in the PR"),
    Rule("introspection", BLOCK, "the op inspects its caller, the harness or the heap",
         "gc.get_objects, stack frames, sys.modules, sys.argv or PYTEST_CURRENT_TEST let an op find "
         "expected outputs or tell a test from a benchmark and behave differently in each.",
         "an op's behaviour depends on its arguments only"),
    Rule("driver-l2", BLOCK, "direct CUDA driver/runtime calls, L2 persistence windows",
         "a persisting L2 access-policy window (or a raised persisting-L2 limit) keeps inputs "
         "resident across timed iterations, so a cold-cache benchmark reads a warm cache; raw "
         "ctypes/cudart calls are outside what the guard can see.",
         "leave cache policy and device limits alone; use the framework's launch APIs"),
    Rule("env-write", BLOCK, "the process environment written",
         "environment variables steer compilers, libraries and the harness (TF32 defaults, "
         "backends, test leniency) for both sides at once.",
         "pass options as arguments; never change the environment from library code"),
    Rule("env-read", WARN, "an environment variable read at call time",
         "a call-time switch can make the benchmarked path differ from the tested one.",
         "read configuration once at import, or take it as an argument"),
    Rule("tensor-subclass", BLOCK, "a tensor subclass or a torch function/dispatch mode",
         "a subclass or mode can defer work until the result is looked at (after the timer stops) "
         "or intercept the checker's comparisons.",
         "return plain torch.Tensor results computed eagerly"),
    Rule("dynamic-code", BLOCK, "code built or loaded at run time (exec, eval, compile, non-literal imports)",
         "code in a string, a pickle or a computed module name is invisible to every static rule: the one "
         "place a cheat can hide from the audit.",
         "write the code out in the op's source files"),
    Rule("shadow-module", BLOCK, "a new file that shadows a module Python would otherwise import",
         "the tree is first on sys.path: a root-level torch.py, time.py or sitecustomize.py, or a "
         "compiled `chunk.*.so` beside `chunk.py` replaces the code that is read and reviewed.",
         "give new modules names that shadow nothing; keep native code in reviewed sources"),
    Rule("test-harness", BLOCK, "a new or changed conftest.py or pytest configuration",
         "pytest loads every conftest.py and its configuration around the frozen test file, so "
         "such a file can patch the checker, skip cases or change options without touching the test.",
         "leave the test machinery alone; if it truly needs a change, make it at the base and re-init"),
    Rule("outside-op", WARN, "an edit outside the op's directory that the op or the bench depends on",
         "shared code changes the base's behaviour for other ops too, and the package __init__ is "
         "where import-time tricks hide.",
         "keep the change inside the op's directory, or justify the shared change in the PR"),
    Rule("not-analysed", WARN, "a changed file the static rules cannot read",
         "native sources, binaries and unparsable files are not checked by the static rules; only "
         "the dynamic probes see their effect.",
         "review these files by hand; prefer the contract's languages"),
]}

# The dynamic probes (flaloop/inside/worker/probes.py and integrity.py, judged in guard/dynamic.py).
PROBE_RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("differs-from-base", BLOCK, "the candidate's outputs or gradients differ from the base's on a bench cell",
         "the gate's shapes are not the bench's: garbage for a shape only the bench uses (seen on FLA), a "
         "bf16-only path, NaN or Inf — a fast wrong answer is not a speedup.",
         "make the candidate agree with the base on every bench cell (relative RMS within --diff-tol)"),
    Rule("unseen-shape-differs", BLOCK, "the candidate differs from the base on a small shape nobody times",
         "the bench's cells and the contract's shapes are a few large ones; a kernel wrong only on a short "
         "sequence, a T off the chunk multiple, a small or odd head dim or a tiny packed batch passes the "
         "differential check there (undoing FLA's fix #988, miscompiled with 4 warps on Hopper, read FASTER "
         "1.10x on B8_T1024_H8_D64 while wrong on B1-T64-H2-D32).",
         "make the candidate agree with the base on every shape the base accepts; rerun with the record's "
         "--unseen-seed to reproduce the shape named, or add it to the gate's tests"),
    Rule("unseen-option-differs", BLOCK, "the candidate differs from the base behind a keyword option the "
         "registry never sets",
         "the registry calls the op one way, so the bench's cells and the unseen shapes never reach a path "
         "behind an option (an initial state, the final state and its gradient, a normalization, a gate "
         "bound): a kernel wrong only there read SAME/SAME on FLA's history.",
         "make the candidate agree with the base with every option the base accepts; the record's "
         "`unseen.options` names the combination and the shape (the same --unseen-seed draws them again)"),
    Rule("test-call-differs", BLOCK, "the candidate differs from the base on one of the test's own calls",
         "the gate runs in the candidate's process, where a candidate can loosen the test's judge (rebind "
         "assert_close to a no-op at import) and read green while wrong on the tests' shapes; the calls "
         "the test made at the base, replayed with fresh values base against candidate in separate "
         "processes, do not depend on anything the candidate's process says.",
         "make the candidate agree with the base on the call named (the record's `test_calls` holds it, "
         "recorded at the base in the gate's calls.json); --test-calls sets how many are replayed"),
    Rule("precision-narrowed", BLOCK, "the candidate differs from the base by more than reordering the cell "
                                      "dtype's arithmetic explains, though within --diff-tol",
         "rounding the inputs, the outputs or an accumulator through a narrower dtype (bf16, fp16, TF32) is "
         "cheaper and stays inside a loose tolerance (a bf16 round trip of an fp32 output: rel-RMS 0.0017, "
         "under the 0.005 default); with the dtype named at run time no static rule reads it.",
         "compute in the cell's dtype; if the base itself runs fp32 at TF32 (its own reorderings differ by "
         "about 2e-4), allow `precision-narrowed` in the contract with that reason"),
    Rule("unseen-off-path", WARN, "the shapes nobody times ran on another backend than the cells",
         "FLA's backends take a call only where their verifier accepts it (the Gluon AttnRes backend no head "
         "dim under 128 bytes); when every unseen shape, the ones drawn with the cells' own head dims too, "
         "went to another backend (or to the op's own code), base and candidate were compared on code the "
         "bench does not time, and a change to the timed backend was checked on the bench's cells alone.",
         "add shapes the backend takes to the gate's tests, or name one in the contract's shapes"),
    Rule("model-trajectory-left-band", BLOCK, "inside a model, the candidate's training run left the base's band",
         "a change inside the op's tolerance (an accumulator narrowed, an exp2 path, a reordered reduction) can "
         "still move a training run; the band is what noise of the tolerance's size on the op's outputs moves "
         "the base's own run by (flaloop model), so a candidate past it changes training more than the "
         "tolerance allows.",
         "keep the base's accumulation and precision where the model's loss is sensitive to it; rerun "
         "`flaloop model OP` to see the step where it left the band"),
    Rule("timer-patched", BLOCK, "a function on the timing path was replaced in the candidate's process",
         "a patched timer fakes any speedup: a wrapped Event.elapsed_time read FASTER 1.25x on an H200 "
         "before this probe existed.",
         "remove the patch; flaloop times with references it kept before importing the target"),
    Rule("timer-wall-gap", BLOCK, "device time falls short of the host wall time of the same batch",
         "for a CUDA-graph sample the wall time is the device time plus a small constant on both sides; "
         "a larger gap on the candidate means its timer reads less than what elapsed.",
         "remove whatever alters CUDA event timing in the candidate's process"),
    Rule("timer-host-gap", BLOCK, "the reported sample time falls short of the round trip flaloop timed",
         "flaloop times each sample request with its own clock in another process; an honest worker "
         "reports less than that round trip by an overhead the base shows too, so a larger gap on the "
         "candidate is time its timer did not count, however the timer was forged (below Python too).",
         "remove whatever alters the clock or the CUDA event timing in the candidate's process"),
    Rule("eager-disagrees", BLOCK, "a device-time speedup the eager wall time does not show",
         "on a cell that is not launch-bound, eager wall time tracks device time; a win only the "
         "events see is a timer trick or work moved out of the timed calls.",
         "check for timer tricks or work moved out of the timed calls"),
    Rule("inputs-mutated", BLOCK, "stale results after the inputs changed in place (same pointers)",
         "an op that caches outputs by pointer, shape or identity returns the previous result when the "
         "same buffers hold new values (KernelBench's adversarial inputs; GPU MODE's identity caches).",
         "compute every call from its inputs; never key results on data_ptr()/id()/shapes"),
    Rule("unwritten-output", BLOCK, "outputs allocated NaN-filled come back with NaN the base does not have",
         "part of the output is never written: correct only while the allocator hands back the right "
         "leftovers (reuse of freed memory).",
         "write every element of every output"),
    Rule("nondeterministic", BLOCK, "two calls on the same inputs disagree (beyond the tolerance: a race)",
         "a race passes a test by luck and measures a path that skips synchronization.",
         "fix the race (atomics order, missing barriers, unsynchronized streams)"),
    Rule("no-own-kernel", BLOCK, "the base launches kernels of its own, the candidate none",
         "the work was delegated to a library or skipped.",
         "keep the computation in the op's own kernels"),
    Rule("library-compute", BLOCK, "library GEMM/attention calls the base does not make",
         "benchmarks someone else's library (cuBLAS, SDPA), usually at another precision.",
         "keep the compute in the op's kernels, or justify the library call"),
    Rule("side-stream", BLOCK, "more kernels off the calling stream, or on more streams, than the base",
         "work on a side stream escapes the events recorded on the timed stream.",
         "run on the current stream"),
    Rule("output-subclass", BLOCK, "an output is a tensor subclass",
         "lazy outputs defer the work until someone reads them, after the timer stopped.",
         "return plain torch.Tensor outputs"),
    Rule("output-aliases-input", BLOCK, "an output shares storage with an input (the base's does not)",
         "writing results into an input buffer corrupts the caller's data and can fake a saved allocation.",
         "return freshly computed outputs"),
    Rule("deferred-work", BLOCK, "outputs changed after the calling stream finished",
         "work deferred to another stream or a thread finishes after the timed events.",
         "finish all work on the calling stream before returning"),
    Rule("backend-differs", BLOCK, "the candidate's calls were served by another backend than the base's",
         "FLA dispatches an op between backends (Triton, TileLang, Gluon, an external package) by priority, "
         "each with a verifier; an edit that makes a verifier decline, a package only one side has, or an "
         "environment that disables a backend moves one side onto other code that agrees within tolerance: "
         "the bench would time a backend switch, not the change.",
         "keep both sides on the same backend; to compare backends on purpose, switch one side with "
         "`--cand-env VAR=VALUE`"),
    Rule("numeric-settings", BLOCK, "numeric settings differ between the sides after the first call",
         "TF32 flags, matmul precision, TRITON_* / FLA_* environment or Triton's fp32 default changed at "
         "import or call time relax the math globally.",
         "leave global numeric settings alone"),
    Rule("lean-import-differs", BLOCK, "the lean import ran under other numeric settings than the real one",
         "`--import lean` skips package __init__ files the op does not name; one of them changed TF32 flags, "
         "a matmul precision or TRITON_* / FLA_* variables at import, so the measured processes did not run "
         "the code the way the package's users do.",
         "bench with `--import full` (the default), or move the setting where the op's own import makes it"),
    Rule("l2-persisting", BLOCK, "a persisting-L2 limit or access-policy window was set",
         "data kept resident in L2 across timed calls skips the HBM traffic the flush is there to force.",
         "do not set persisting L2 (cudaLimitPersistingL2CacheSize, accessPolicyWindow)"),
    Rule("below-floor", BLOCK, "faster than the roofline floor of the cell",
         "a result that beats the device's copy bandwidth or GEMM rate on the bytes and FLOPs the op must "
         "move is not computed (docs/ROOFLINE.md); a near-zero cell also collapses an equal-weight geomean.",
         "check what the candidate skips on this cell"),
    Rule("implausible-speedup", BLOCK, "a clear win on a candidate whose code is the base's",
         "a diff that changes only comments, docstrings or layout runs the base's code, so a speedup "
         "beyond noise comes from something the diff does not show: the environment, a cache, the "
         "measurement. (An allowance under this id also covers `below-floor`, which had this id before.)",
         "find what differs between the two sides besides the code; measure again with `--exclusive`"),
    Rule("contended-unsure", WARN, "a timing cross-check could not decide beside another process on the GPU",
         "the pairs it rests on ran while other processes shared the GPU, and the candidate's difference "
         "from the base lies within what the base's own readings spread by there: neither a cheat nor "
         "an honest change can be told from the contention.",
         "measure again with `--exclusive` (waits for a free GPU and drops pairs beside others)"),
    Rule("graph-escape", BLOCK, "kernels the eager call runs are missing from a replay of the captured graph",
         "work launched outside the capture (or skipped while capturing) is not replayed: the timed graph "
         "does less than the op, and its outputs are only right while the inputs do not change "
         "(FlashInfer-Bench #414; AKO4X's TRAPS).",
         "launch every kernel of the call on the current stream, the same way captured or not"),
    Rule("self-check", BLOCK, "a measuring process computes otherwise after its timed samples than before them",
         "the warm-up's checks and probes run in another process, after a few calls; an op that changes "
         "once it has been called many times, has lived long, sees the same input objects again or was "
         "captured into a graph (a cache, a counter, a skipped step) is measured doing something the "
         "checks never saw.",
         "compute every call the same way from its inputs, whatever came before it"),
    Rule("timed-call-differs", BLOCK, "a timed call of the candidate, drawn at random, differs from the base's "
                                      "same call on the same inputs",
         "every other check calls the op outside the timed samples (the warm-up, the probes, the self-check); "
         "an op whose results go wrong only while it is timed (keyed on a call counter, the process's age, a "
         "graph being captured, the timing loop, or inputs it has seen) passes them all, and what is timed is "
         "work nobody checked (GPU MODE reference-kernels #104 and #142; AgentKernelArena #82: one validation "
         "call after timing is dodged by state-dependent behaviour).",
         "compute every call the same way from its inputs, whatever came before it and whoever is watching"),
    Rule("probe-error", WARN, "a probe could not run on this cell",
         "a probe that fails checks nothing.",
         "read the worker's stderr in the run directory"),
]}
RULES.update(PROBE_RULES)

# compute-sanitizer on the base and the candidate (flaloop/diagnose/sanitizer/flow.py): what only the candidate has.
SANITIZER_RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("sanitizer-memcheck", BLOCK, "an out-of-bounds or misaligned access, or a CUDA error, only the candidate has "
                                      "(compute-sanitizer memcheck)",
         "a kernel that reads or writes past its tensors passes the tests while the bytes beyond happen to be "
         "harmless (inside PyTorch's caching allocator they usually are): it corrupts other tensors or faults on "
         "another shape, allocation order or GPU, and its time includes accesses it should not make.",
         "fix the masks and offsets (the tails of tl.load/tl.store, the last block of the grid); the raw log in "
         "profile/<op>-opt/sanitize/ names the kernel, thread and address"),
    Rule("sanitizer-racecheck", BLOCK, "a shared-memory data race only the candidate has (compute-sanitizer racecheck)",
         "threads that read shared memory another thread of the block writes, with no barrier between, read "
         "whatever the schedule gives them: right in the tests by luck, wrong on another GPU, clock or occupancy; "
         "a barrier dropped for speed is a speedup that is not one.",
         "put the barrier back between the write and the read (tl.debug_barrier, __syncthreads), or "
         "double-buffer the shared memory"),
    Rule("sanitizer-initcheck", BLOCK, "device memory read before anything wrote it, only in the candidate "
                                       "(compute-sanitizer initcheck)",
         "a buffer from torch.empty read before it is written holds the allocator's leftovers: the result is "
         "right only while those happen to be (the unwritten-output probe sees whole outputs; this sees single "
         "loads, workspaces included).",
         "write before reading: zero what is accumulated into (torch.zeros), or mask the loads of what is not "
         "written yet"),
    Rule("sanitizer-synccheck", BLOCK, "a barrier used invalidly (divergent threads), only in the candidate "
                                       "(compute-sanitizer synccheck)",
         "a barrier that only some threads of a block or warp reach (under a branch on the thread index) is "
         "undefined: it hangs or silently does not synchronize, depending on the GPU and the compiler.",
         "keep barriers out of divergent branches: every thread of the block must reach each one"),
]}
RULES.update(SANITIZER_RULES)

# At a go (flaloop/diagnose/explain.py): the win set against the kernels that should explain it. No --allow:
# a go either has its explanation or it does not.
UNEXPLAINED = Rule(
    "unexplained-speedup", BLOCK, "a win the kernels do not account for (profiled at the go)",
    "a speedup you can't account for is a silent-skip suspect: work that runs only when nobody profiles, "
    "only outside the timed calls, or not at all, while the kernels that should show the win do not.",
    "find where the time went: `flaloop profile OP --shape S --mode M` shows both sides' traces; if the "
    "profile is only noisy, `flaloop explain OP --steps 50`")
RULES[UNEXPLAINED.id] = UNEXPLAINED


# Wrong results are not a trade-off a reviewer can accept: these are never allowed.
NEVER_ALLOWED = frozenset({"differs-from-base", "unseen-shape-differs", "unseen-option-differs", "test-call-differs",
                           "timed-call-differs"})


def known(rule_id: str) -> bool:
    return rule_id in RULES


def finding(rule_id: str, message: str, *, file: str | None = None, line: int | None = None,
            severity: str | None = None) -> Finding:
    """A Finding for `rule_id`, with the rule's why and fix."""
    r = RULES[rule_id]
    fix = r.fix if rule_id in NEVER_ALLOWED else f"{r.fix}; {_ALLOW.format(id=rule_id)}"
    return Finding(rule=rule_id, severity=severity or r.severity, message=message, why=r.why,
                   fix=fix, file=file, line=line)
