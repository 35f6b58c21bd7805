"""Entry point of the benchmark worker (see __init__.py). Only the standard library is imported
here; the stdout fd is claimed for the protocol before anything else can print."""

import importlib.util
import os
import sys

PACKAGE = '_flaloop_worker'


def _load_package():
    here = os.path.dirname(os.path.realpath(__file__))
    # Running by path puts this directory first on sys.path: its module names must not shadow
    # the target's (a target may well have a `protocol` or `inputs` module).
    sys.path[:] = [p for p in sys.path if not (p and os.path.realpath(p) == here)]
    spec = importlib.util.spec_from_file_location(PACKAGE, os.path.join(here, '__init__.py'),
                                                  submodule_search_locations=[here])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module(f'{PACKAGE}.server')


def _arm_lifeline() -> None:
    """Exit when flaloop is gone, from the first instant (importing torch takes seconds): see
    flaloop/inside/scripts/flaloop_lifeline.py. A forked worker arms it right after the fork, watching the
    flaloop process named in its environment (the fork server runs no thread and outlives runs)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
                        'scripts', 'flaloop_lifeline.py')
    spec = importlib.util.spec_from_file_location('_flaloop_lifeline', path)
    if spec is not None and spec.loader is not None and os.path.exists(path):
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.arm()


def _forkserver(argv) -> int:
    # __main__.py --forkserver PATH --preload FILE (one module name a line) --key KEY --idle S:
    # see forkserver.py
    path = argv[1]
    opts = dict(zip(argv[2::2], argv[3::2], strict=False))
    names = []
    if opts.get('--preload'):
        with open(opts['--preload'], encoding='utf-8') as f:
            names = [line.strip() for line in f if line.strip()]
    server = _load_package()
    forkserver = importlib.import_module(f'{PACKAGE}.forkserver')

    def entry(proto, args):
        _arm_lifeline()  # in the forked child: it watches the flaloop that asked for it
        if args[:1] == ['--pytest']:  # the gate's test process, not a worker: it speaks no protocol
            proto.close()
            return forkserver.run_pytest(args[1:])
        if args[:1] == ['--script']:  # a script of flaloop's (the op query): no protocol either
            proto.close()
            return forkserver.run_script(args[1:])
        return server.main(proto, args)

    return forkserver.serve(path, names, entry, key=opts.get('--key', ''), idle_s=float(opts.get('--idle', 900)))


if __name__ == '__main__':
    if sys.argv[1:2] == ['--forkserver']:  # no thread here: the server refuses to fork with one
        sys.exit(_forkserver(sys.argv[1:]))
    _arm_lifeline()
    try:
        sys.stdout.flush()
    except Exception:
        pass
    proto_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    proto = os.fdopen(proto_fd, 'w', encoding='utf-8', buffering=1)
    sys.exit(_load_package().main(proto, sys.argv[1:]))
