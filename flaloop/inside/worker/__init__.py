"""The benchmark worker: runs inside the *target's* interpreter, one process per side.

Started by path (`python -u flaloop/inside/worker/__main__.py --tree T --registry R --op OP
--side base|cand`), it loads this package under the private name `_flaloop_worker`, so nothing
here imports flaloop (the target's interpreter need not have it) and no module name of ours can
shadow one of the target's. The orchestrator never imports this package (bench/launcher.py starts it by path).

Modules, in the order a request meets them:
  protocol   JSON lines on a private copy of stdout; fd 1 and sys.stdout go to stderr
  server     the `WorkerServer` and its commands (hello, setup, probe, sample, eager, dump, compare, release)
  op_import  the registry and the op, imported from the tree under test
  integrity  references to every timing function, kept before the target is imported, and checks
  inputs     deterministic input sets built from the registry's TensorSpecs
  cell       one bench cell: inputs, calls, the timer chosen, samples
  timing     CUDA events, graph capture and its proof, k calibration, L2 flush
  outputs    outputs by name, relative RMS differences, dumps and comparisons across processes
  probes     the guard's dynamic probes (docs/GUARD.md)
  model      a model cell: training steps of a causal LM from the tree, its trajectory, the op's share
  tuning     what Triton's autotuners picked
  backends   which backend of the target's dispatch registries served the calls
"""
