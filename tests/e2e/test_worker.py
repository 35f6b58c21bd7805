"""Tests of the bench worker (flaloop/inside/worker/) driven through its pipes, as the orchestrator does.

A tiny fake target (a registry in FLA's interface and a pure-torch op package) is written to tmp
dirs; the worker runs in this interpreter (which has torch) on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip('torch')

from support.worker import TIMEOUT_S, WORKER, Driver, cell, make_tree  # noqa: E402


@pytest.fixture(scope='module')
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp('trees')
    return {
        'base': make_tree(root / 'base'),
        'cand': make_tree(root / 'cand'),
        'off': make_tree(root / 'off', FACTOR=1.01, EXTRA=True),
        'nan': make_tree(root / 'nan', NAN=True),
    }


@pytest.fixture(scope='module')
def workers(trees):
    started = {}

    def get(tree: str, op: str = 'toy_op', side: str | None = None) -> Driver:
        key = (tree, op)
        if key not in started:
            started[key] = Driver(trees[tree], op, side or ('base' if tree == 'base' else 'cand'), forked=True)
        return started[key]

    # forked from one warm server, as a bench's workers are by default (spawned ones are tested below)
    for key in [('base', 'toy_op'), ('cand', 'toy_op'), ('off', 'toy_op'), ('nan', 'toy_op'),
                ('base', 'toy_ident'), ('base', 'toy_varlen'), ('base', 'toy_gate'), ('cand', 'toy_gate'),
                ('base', 'toy_nobwd')]:
        get(*key)
    yield get
    for w in started.values():  # EOF to all first: they exit in parallel
        w.p.stdin.close()
    for w in started.values():
        w.close()
        assert w.p.returncode == 0, (w.p.returncode, w.errpath.read_text()[-4000:])


def test_hello_reports_op_inside_tree(workers, trees):
    w = workers('base')
    r = w.ok('hello')
    tree = os.path.realpath(trees['base'])
    assert r['side'] == 'base'
    assert r['op_module_file'].startswith(tree + os.sep), r
    assert r['op_func_file'].startswith(tree + os.sep), r
    assert r['op_func_file'].endswith(os.path.join('toyop', 'ops', 'scale', '__init__.py'))
    assert r['device'] == 'cpu' and r['device_uuid'] is None
    assert r['torch'] == torch.__version__ and r['python'] and r['pid'] == w.p.pid
    cand = workers('cand').ok('hello')
    assert cand['side'] == 'cand'
    assert cand['op_module_file'].startswith(os.path.realpath(trees['cand']) + os.sep)


@pytest.mark.parametrize('mode', ['fwd', 'fwdbwd'])
def test_identical_trees_dump_identically_and_compare_exact(workers, tmp_path, mode):
    base, cand = workers('base'), workers('cand')
    c = cell(f'same-{mode}', mode=mode, seed=3)
    rb, rc = base.ok('setup', cell=c), cand.ok('setup', cell=c)
    for r in (rb, rc):
        assert r['timer'] == 'cpu' and r['n_sets'] == 1 and r['k'] >= 1
        assert r['capture_error'] is None and r['graph_bitwise_equal'] is None
    expected = {'out0': 0} if mode == 'fwd' else {'out0': 0, 'grad_q': 0, 'grad_k': 0, 'grad_v': 0}
    assert rb['nonfinite'] == expected
    # q, k, v (+ do) of 2*8*2*4 float32
    assert rb['set_bytes'] == 512 * (3 if mode == 'fwd' else 4)
    db = base.ok('dump', cell=c['id'], path=str(tmp_path / 'base.pt'))
    dc = cand.ok('dump', cell=c['id'], path=str(tmp_path / 'cand.pt'))
    assert db['names'] == list(expected) == dc['names']
    assert db['shapes']['out0'] == [2, 8, 2, 4]
    tb, tc = torch.load(tmp_path / 'base.pt'), torch.load(tmp_path / 'cand.pt')
    for name in expected:
        assert torch.equal(tb[name], tc[name]), name  # same seed -> same inputs on both sides
        assert tb[name].abs().sum() > 0
    r = base.ok('compare', cell=c['id'], subject=str(tmp_path / 'cand.pt'), tol=1e-6)
    assert r['match'] is True
    assert all(t['rel_rms'] == 0.0 and t['max_abs'] == 0.0 for t in r['tensors'].values()), r


def test_only_the_base_judges_and_it_holds_its_own_results_in_memory(workers, tmp_path):
    base, cand = workers('base'), workers('cand')
    c = cell('judge', seed=6)
    base.ok('setup', cell=c)
    cand.ok('setup', cell=c)
    d = cand.ok('dump', cell='judge', path=str(tmp_path / 'cand.pt'))
    # a candidate is never handed another side's results, nor asked for a verdict
    for theirs in ({'ref': d['path']}, {'subject': d['path']}, {'shared': 'x'}):
        r = cand.req('compare', cell='judge', tol=1e-6, **theirs)
        assert r['ok'] is False and 'base only' in r['error'], r
    held = base.ok('dump', cell='judge', hold=True)
    assert held['held'] is True and 'path' not in held and held['names'] == d['names']
    assert not list(tmp_path.glob('*base*'))
    r = base.ok('compare', cell='judge', subject=d['path'], tol=1e-6)
    assert r['match'] is True and r['tensors']['out0']['rel_rms'] == 0.0
    assert base.req('dump', cell='judge', hold=True, mutated=True)['ok'] is False


def test_seed_changes_inputs(workers, tmp_path):
    base = workers('base')
    base.ok('setup', cell=cell('s0', seed=0))
    base.ok('setup', cell=cell('s1', seed=1))
    base.ok('dump', cell='s0', path=str(tmp_path / 's0.pt'))
    r = base.ok('compare', cell='s1', ref=str(tmp_path / 's0.pt'), tol=1e-3)
    assert r['match'] is False and r['tensors']['out0']['rel_rms'] > 0.1


def test_a_rounds_draw_changes_the_values_alike_on_both_sides_and_the_warmups_draw_is_the_seed(workers, tmp_path):
    base, cand = workers('base'), workers('cand')
    out = {}
    for draw in (None, '', 'salt:r1', 'salt:r2'):
        c = cell(f'draw-{draw}', seed=4, **({'draw': draw} if draw is not None else {}))
        for name, w in (('base', base), ('cand', cand)):
            w.ok('setup', cell=c)
            w.ok('dump', cell=c['id'], path=str(tmp_path / f'{name}-{draw}.pt'))
            out[name, draw] = torch.load(tmp_path / f'{name}-{draw}.pt')['out0']
    for draw in (None, '', 'salt:r1', 'salt:r2'):
        assert torch.equal(out['base', draw], out['cand', draw]), draw  # one draw, both sides
    assert torch.equal(out['base', None], out['base', ''])  # no draw is the warm-up's: the seed alone
    assert not torch.allclose(out['base', 'salt:r1'], out['base', 'salt:r2'])
    assert not torch.allclose(out['base', None], out['base', 'salt:r1'])


@pytest.mark.parametrize('timer_cold', [False, True])
def test_a_kept_timed_call_crosses_to_the_base_which_judges_it(workers, tmp_path, timer_cold):
    base, cand, off = workers('base'), workers('cand'), workers('off')
    c = cell('kept', mode='fwdbwd', k=4, draw='salt:r1', **({'l2': 'cold'} if timer_cold else {}))
    for w in (base, cand, off):
        w.ok('setup', cell=c)
    assert 'kept' not in base.ok('sample', cell='kept')  # no "keep": nothing copied
    assert base.req('compare', cell='kept', ref=str(tmp_path / 'none.pt'), kept=True)['ok'] is False
    for w in (base, cand, off):
        r = w.ok('sample', cell='kept', keep=2)
        assert r['times_ms'][0] > 0 and r['keep_s'] >= 0
    assert set(r['kept']) >= {'s0:out0', 's0:grad_q', 's0:grad_k', 's0:grad_v'}, r['kept']
    for i, (w, match) in enumerate(((cand, True), (off, False))):
        path = tmp_path / f'kept-{i}.pt'
        d = w.ok('dump', cell='kept', path=str(path), kept=True)
        assert 's0:grad_q' in d['names']
        r = base.ok('compare', cell='kept', ref=str(path), kept=True, tol=1e-3)
        assert r['match'] is match and r['sets'] == ['s0'], r
    assert r['tensors']['s0:out0']['rel_rms'] == pytest.approx(0.01, rel=1e-3)  # the 'off' tree's factor
    # a later sample without "keep" leaves the kept call alone; an empty dump is no match
    base.ok('sample', cell='kept')
    torch.save({}, tmp_path / 'empty.pt')
    assert base.ok('compare', cell='kept', ref=str(tmp_path / 'empty.pt'), kept=True, tol=1.0)['match'] is False


def test_different_candidate_mismatches_without_crash(workers, tmp_path):
    base, off = workers('base'), workers('off')
    c = cell('diff', seed=5)
    base.ok('setup', cell=c)
    off.ok('setup', cell=c)
    off.ok('dump', cell='diff', path=str(tmp_path / 'off.pt'))
    r = base.ok('compare', cell='diff', subject=str(tmp_path / 'off.pt'), tol=1e-3)
    assert r['match'] is False
    assert r['tensors']['out0']['rel_rms'] == pytest.approx(0.01, rel=1e-3)
    assert r['tensors']['out0']['match'] is False
    # the extra output exists only on this side: a name mismatch, reported, not a crash
    assert r['tensors']['out2']['missing'] == 'ref' and r['tensors']['out2']['match'] is False
    # and the other way round
    r = base.ok('compare', cell='diff', ref=str(tmp_path / 'off.pt'), tol=1.0)
    assert r['match'] is False and r['tensors']['out2']['missing'] == 'self'
    assert r['tensors']['out0']['match'] is True


def test_shape_mismatch_is_a_mismatch(workers, tmp_path):
    base = workers('base')
    base.ok('setup', cell=cell('small'))
    base.ok('setup', cell=cell('big', shape={'B': 1, 'T': 5, 'H': 2, 'D': 4}))
    base.ok('dump', cell='small', path=str(tmp_path / 'small.pt'))
    r = base.ok('compare', cell='big', ref=str(tmp_path / 'small.pt'), tol=1.0)
    assert r['match'] is False
    t = r['tensors']['out0']
    assert t['shape'] == [1, 5, 2, 4] and t['shape_ref'] == [2, 8, 2, 4] and t['rel_rms'] is None


def test_nan_candidate_reports_nonfinite(workers, tmp_path):
    base, nan = workers('base'), workers('nan')
    c = cell('nan', mode='fwdbwd')
    r = nan.ok('setup', cell=c)
    assert r['nonfinite']['out0'] == 1
    base.ok('setup', cell=c)
    base.ok('dump', cell='nan', path=str(tmp_path / 'ref.pt'))
    d = nan.ok('dump', cell='nan', path=str(tmp_path / 'nan.pt'))
    assert d['nonfinite']['out0'] == 1
    r = base.ok('compare', cell='nan', subject=str(tmp_path / 'nan.pt'), tol=1.0)
    assert r['match'] is False
    assert r['tensors']['out0']['nonfinite_self'] == 1 and r['tensors']['out0']['nonfinite_ref'] == 0
    r = base.ok('compare', cell='nan', ref=str(tmp_path / 'nan.pt'), tol=1.0)
    assert r['match'] is False and r['tensors']['out0']['nonfinite_ref'] == 1
    assert json.dumps(r, allow_nan=False)  # strict JSON: no NaN leaked into the reply


def test_sample_and_eager_times(workers):
    base = workers('base')
    r = base.ok('setup', cell=cell('t', mode='fwdbwd', k=3, n_sets=2))
    assert r['k'] == 3 and r['n_sets'] == 2 and r['timer'] == 'cpu'
    s = base.ok('sample', cell='t', n=4)
    assert len(s['times_ms']) == 4 and all(t > 0 for t in s['times_ms'])
    e = base.ok('eager', cell='t', n=3)
    assert len(e['host_ms']) == 3 and len(e['wall_ms']) == 3
    assert all(h > 0 and w >= h for h, w in zip(e["host_ms"], e["wall_ms"], strict=True))
    assert base.ok('sample', cell='t')['times_ms'][0] > 0  # n defaults to 1
    # calibration: k chosen from sample_ms, capped at 256
    r = base.ok('setup', cell=cell('cal', sample_ms=1e6))
    assert r['k'] == 256
    assert base.ok('release', cell='cal')['released'] is True
    assert base.req('sample', cell='cal')['ok'] is False


def test_each_l2_state_sets_the_cell_up_and_a_cold_sample_leaves_the_flush_out_of_its_time(workers):
    """hot: one input set whatever n_sets asks; cold on the CPU: each call timed alone after the
    cache flush, which is slower than the toy call by far, so a flush inside the time would show."""
    from flaloop.inside.worker import timing

    base = workers('base')
    hot = base.ok('setup', cell=cell('hot', l2='hot', n_sets=3, k=2))
    assert hot['l2'] == 'hot' and hot['n_sets'] == 1 and hot['flush_ms'] is None
    assert base.ok('setup', cell=cell('rot', n_sets=3, k=2))['n_sets'] == 3  # rotate: as asked
    cold = base.ok('setup', cell=cell('cold', l2='cold', k=4))
    assert cold['l2'] == 'cold' and cold['timer'] == 'cpu'
    flush = timing.L2Flush(torch.device('cpu'), None)
    flush()
    flush_ms = sorted(timing.cpu_time_ms(flush) for _ in range(3))[1]
    times = base.ok('sample', cell='cold', n=5)['times_ms']
    assert all(t > 0 for t in times) and sorted(times)[2] < flush_ms / 3, (times, flush_ms)
    eager = base.ok('eager', cell='cold', n=3)['wall_ms']  # the eager cross-check's samples: the same state
    assert all(w > 0 for w in eager) and sorted(eager)[1] < flush_ms / 3, (eager, flush_ms)
    bad = base.req('setup', cell=cell('bad', l2='warm'))
    assert bad['ok'] is False and "l2 must be one of ['rotate', 'hot', 'cold'], got 'warm'" in bad['error']
    for c in ('hot', 'rot', 'cold'):
        base.ok('release', cell=c)


def test_a_cold_cells_flushes_are_held_to_its_sample_budget_like_its_calls(workers):
    """k calls make a sample of sample_ms; in a cold cell each call also runs a flush, which on a CPU
    costs far more than the toy call (a last-level cache of hundreds of MiB takes a tenth of a
    second), so its k is the flush's, not the call's: a cell of 8 pairs once ran 400 s for it."""
    import math

    from flaloop.inside.worker import timing

    base = workers('base')
    flush = timing.L2Flush(torch.device('cpu'), None)
    flush()
    readings = [timing.cpu_time_ms(flush) for _ in range(3)]
    sample_ms = 10.0
    hot = base.ok('setup', cell=cell('hot10', l2='hot', sample_ms=sample_ms))
    cold = base.ok('setup', cell=cell('cold10', l2='cold', sample_ms=sample_ms))
    readings += [timing.cpu_time_ms(flush) for _ in range(3)]
    # the fastest reading, before or after the worker's own: a loaded CPU stretches a flush by a factor
    # of 3 or more between two moments (14.3 ms here where the worker's read under 4 ms), never shortens it
    flush_ms = min(readings)
    assert hot['k'] > cold['k'] >= 1, (hot['k'], cold['k'], readings)
    # a k set by the call alone would be the hot cell's (hundreds); the flush's keeps it near sample/flush,
    # read as the worker read it (its flush buffer and its moment), else as read here
    worker_flush = cold.get('flush_ms') or flush_ms
    assert cold['k'] <= max(1, math.ceil(2 * sample_ms / min(flush_ms, worker_flush))), (cold['k'], readings, cold.get('flush_ms'))
    for c in ('hot10', 'cold10'):
        base.ok('release', cell=c)


def test_set0_independent_of_n_sets_and_nonzero(workers, tmp_path):
    ident = workers('base', 'toy_ident')
    ident.ok('setup', cell=cell('one', seed=7))
    ident.ok('setup', cell=cell('two', seed=7, n_sets=2))
    ident.ok('dump', cell='one', path=str(tmp_path / 'one.pt'))
    ident.ok('dump', cell='two', path=str(tmp_path / 'two.pt'))
    a, b = torch.load(tmp_path / 'one.pt'), torch.load(tmp_path / 'two.pt')
    assert torch.equal(a['out0'], b['out0'])  # set 0 does not depend on n_sets
    assert (a['out0'] != 0).all()  # never zeros


def test_l2norm_override_gives_unit_rows(workers, tmp_path):
    ident = workers('base', 'toy_ident')
    ident.ok('setup', cell=cell('l2', inputs={'x': 'l2norm'}, shape={'B': 1, 'T': 6, 'H': 3, 'D': 16}))
    ident.ok('dump', cell='l2', path=str(tmp_path / 'l2.pt'))
    x = torch.load(tmp_path / 'l2.pt')['out0']
    assert x.shape == (1, 6, 3, 16)
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(1, 6, 3), rtol=1e-5, atol=1e-5)
    ident.ok('setup', cell=cell('sig', inputs={'x': 'sigmoid'}))
    ident.ok('dump', cell='sig', path=str(tmp_path / 'sig.pt'))
    x = torch.load(tmp_path / 'sig.pt')['out0']
    assert ((x > 0) & (x < 1)).all()


def test_registry_transform_and_post_init_are_deterministic(workers, tmp_path):
    base, cand = workers('base', 'toy_gate'), workers('cand', 'toy_gate')
    c = cell('gate', mode='fwdbwd', dtype='bfloat16', seed=11, n_sets=2)
    rb = base.ok('setup', cell=c)
    assert set(rb['nonfinite']) == {'out0', 'grad_q', 'grad_k', 'grad_v', 'grad_g'}
    cand.ok('setup', cell=c)
    cand.ok('dump', cell='gate', path=str(tmp_path / 'gate.pt'))
    r = base.ok('compare', cell='gate', subject=str(tmp_path / 'gate.pt'), tol=0.0)  # only the base judges
    assert r['match'] is True, r
    assert torch.load(tmp_path / 'gate.pt')['out0'].dtype == torch.bfloat16


def test_shared_results_fall_back_to_the_file_off_the_gpu_and_refuse_foreign_payloads(workers, tmp_path):
    """`dump` with share: CPU tensors cannot cross as CUDA IPC handles, so they go to the file and
    the reply says why; a `shared` payload naming anything but torch's rebuilder is refused before
    it runs, and the base (the only side that judges) answers with `shared_error` (the session then
    sends the file)."""
    import base64
    import pickle

    base, cand = workers('base'), workers('cand')
    c = cell('sh', mode='fwd', dtype='float32', seed=5)
    base.ok('setup', cell=c)
    cand.ok('setup', cell=c)
    d = cand.ok('dump', cell='sh', share=True, path=str(tmp_path / 'sh.pt'))
    assert 'shared' not in d and 'not a GPU' in d['share_error'] and (tmp_path / 'sh.pt').exists()
    r = cand.req('dump', cell='sh', share=True)
    assert r['ok'] is False and 'not a GPU' in r['error']
    assert base.ok('compare', cell='sh', subject=str(tmp_path / 'sh.pt'), tol=0.0)['match'] is True
    marker = tmp_path / 'ran'
    evil = base64.b64encode(pickle.dumps({'out0': (os.system, (f'touch {marker}',))})).decode()
    r = base.ok('compare', cell='sh', subject_shared=evil, tol=0.0)
    assert 'system' in r['shared_error'] and 'match' not in r and not marker.exists()
    # the mutation probe's results travel the same way: rolled inputs give other values
    cand.ok('dump', cell='sh', mutated=True, path=str(tmp_path / 'mut.pt'))
    assert base.ok('compare', cell='sh', mutated=True, subject=str(tmp_path / 'mut.pt'), tol=0.0)['match'] is True
    r = base.ok('compare', cell='sh', subject=str(tmp_path / 'mut.pt'), tol=1e-3)
    assert r['match'] is False, r
    assert cand.ok('unshare')['unshared'] is False
    # a candidate never judges: nothing of the base's is ever handed to its process
    r = cand.req('compare', cell='sh', subject=str(tmp_path / 'sh.pt'), tol=0.0)
    assert r['ok'] is False and 'base only' in r['error']


def test_the_shared_results_unpickler_takes_what_torch_writes_for_a_cuda_tensor():
    """What torch.multiprocessing's reduce_tensor returns for a CUDA tensor (its class, size, storage
    class, dtype, handles), built here without a GPU: the candidate must be able to read it (the
    H200 run of 2026-11-30 fell back to the file because TypedStorage was missing from the list)."""
    import base64
    import io
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from flaloop.inside.worker.outputs import _SharedUnpickler

    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    args = (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, 0, b'handle', 12, 0, False,
            b'refcounter', 0, b'event', True)
    payload = base64.b64encode(pickle.dumps({'out0': (rebuild_cuda_tensor, args)}))
    items = _SharedUnpickler(io.BytesIO(base64.b64decode(payload))).load()
    assert items['out0'][0] is rebuild_cuda_tensor and items['out0'][1] == args


def test_the_collector_is_off_inside_a_timed_window_and_back_after_it():
    """A collection in the timed window would be counted as the op's time (on a GPU: between the
    start event and the launch); the timers turn it off there, and leave a disabled one disabled."""
    import gc

    from flaloop.inside.worker import timing

    seen = []
    assert gc.isenabled()
    assert timing.cpu_time_ms(lambda: seen.append(gc.isenabled())) >= 0
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ZeroDivisionError):
        timing.cpu_time_ms(lambda: 1 / 0)
    assert gc.isenabled()
    gc.disable()
    try:
        timing.cpu_time_ms(lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_errors_keep_the_worker_answering(workers):
    base = workers('base')
    r = base.req('setup', cell=cell('bad', inputs={'q': 'cube'}))
    assert r['ok'] is False and 'l2norm' in r['error'] and r['traceback']
    r = base.req('frobnicate')
    assert r['ok'] is False and 'frobnicate' in r['error']
    r = base.req('setup', cell=cell('bad', inputs={'nope': 'identity'}))
    assert r['ok'] is False
    r = base.req('setup', cell=cell('bad', dtype='float64'))
    assert r['ok'] is False
    r = base.raw('this is not json\n')
    assert r['ok'] is False and 'bad request' in r['error']
    r = base.req('dump', cell='never-set-up', path='/nonexistent/x.pt')
    assert r['ok'] is False and 'never-set-up' in r['error']
    assert base.ok('hello')['side'] == 'base'


def test_skips(workers):
    nobwd = workers('base', 'toy_nobwd')
    r = nobwd.req('setup', cell=cell('b', mode='fwdbwd'))
    assert r['ok'] is False and r['error'].startswith('skip:') and r['skip'] is True
    r = nobwd.req('setup', cell=cell('d', shape={'B': 1, 'T': 4, 'H': 1, 'D': 16}))
    assert r['ok'] is False and r['error'].startswith('skip:') and 'D' in r['error']
    nobwd.ok('setup', cell=cell('fine'))
    r = nobwd.req('setup', cell=cell('v', seqlens=[2, 3], shape={'B': 1, 'H': 1, 'D': 4}))
    assert r['ok'] is False and r['error'] == 'skip: op takes no cu_seqlens'


def test_varlen_passes_cu_seqlens(workers, tmp_path):
    w = workers('base', 'toy_varlen')
    c = cell('vl', mode='fwdbwd', seqlens=[3, 5, 1], shape={'B': 1, 'H': 2, 'D': 4})
    r = w.ok('setup', cell=c)
    assert r['extra_kwargs'] == ['cu_seqlens']
    d = w.ok('dump', cell='vl', path=str(tmp_path / 'vl.pt'))
    assert d['shapes']['out0'] == [1, 9, 2, 4]
    t = torch.load(tmp_path / 'vl.pt')
    assert t['out1'].tolist() == [0, 3, 8, 9] and t['out1'].dtype == torch.long
    assert 'grad_x' in t
    r = w.req('setup', cell=cell('vl2', seqlens=[3, 5], shape={'B': 2, 'H': 2, 'D': 4}))
    assert r['ok'] is False and 'B' in r['error']


def test_stdout_noise_does_not_break_protocol(workers):
    # toy_op prints on sys.stdout and writes to fd 1 on every call; every reply so far parsed as JSON,
    # so here check the noise went to stderr
    base = workers('base')
    base.ok('setup', cell=cell('noise'))
    base.ok('sample', cell='noise', n=2)
    err = base.stderr()
    assert 'noise from toy_op on stdout' in err and 'raw fd-1 noise' in err


def test_eof_and_quit_exit_zero(trees, tmp_path):
    w = Driver(trees['base'], 'toy_op', 'base', workdir=tmp_path / 'wd')
    q = Driver(trees['cand'], 'toy_op', 'cand', workdir=tmp_path / 'wd')
    try:
        w.p.stdin.close()
        assert w.p.wait(timeout=TIMEOUT_S) == 0, w.stderr()
        r = q.req('quit')
        assert r['ok'] is True
        assert q.p.wait(timeout=TIMEOUT_S) == 0, q.stderr()
    finally:
        w.close()
        q.close()


def test_init_error_is_reported_not_fatal(trees, tmp_path):
    w = Driver(trees['base'], 'no_such_op', 'base', workdir=tmp_path)
    try:
        r = w.req('hello')
        assert r['ok'] is False and 'no_such_op' in r['error'] and 'toy_op' in r['traceback']
        assert w.req('quit')['ok'] is True
        assert w.p.wait(timeout=TIMEOUT_S) == 0
    finally:
        w.close()


def test_worker_imports_nothing_of_flaloop():
    pkg = WORKER.parent
    for f in pkg.glob('*.py'):
        src = f.read_text()
        assert 'import flaloop' not in src and 'from flaloop' not in src, f
    # the entry point does no work when imported (no torch import, no package load)
    code = ('import importlib.util, sys; s = importlib.util.spec_from_file_location("w", sys.argv[1]); '
            'm = importlib.util.module_from_spec(s); s.loader.exec_module(m); print("torch" in sys.modules)')
    out = subprocess.run([sys.executable, '-c', code, str(WORKER)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == 'False'


# ---------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------

GPU_OP_EXTRA = '''

def toy_sync(q, k, v, scale=None):
    s = float((q * k).sum().item())      # host sync: not capturable
    return (q * k).sum(-1, keepdim=True) * v * (1.0 + 0.0 * s), None
'''

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')


@pytest.mark.gpu
@cuda
def test_gpu_graph_timer_and_proof(tmp_path):
    tree = make_tree(tmp_path / 'gpu')
    src = tree / 'toyop' / 'ops' / 'scale' / '__init__.py'
    src.write_text(src.read_text() + GPU_OP_EXTRA)
    reg = tree / 'benchmarks' / 'ops' / 'registry.py'
    reg.write_text(reg.read_text() + "\nregister_op(OpConfig(name='toy_sync', import_path='toyop.ops.scale', "
                   'inputs=dict(_qkv)))\n')
    w = Driver(tree, 'toy_op', 'base', device='cuda')
    c = Driver(tree, 'toy_op', 'cand', device='cuda')
    s = Driver(tree, 'toy_sync', 'base', device='cuda')
    try:
        h = w.ok('hello')
        assert h['device'] == 'cuda' and h['l2_bytes'] and h['device_uuid']
        shape = {'B': 2, 'T': 256, 'H': 4, 'D': 64}
        for mode in ('fwd', 'fwdbwd'):
            r = w.ok('setup', cell=cell(mode, mode=mode, dtype='bfloat16', shape=shape))
            assert r['timer'] == 'cuda_graph', r
            assert r['capture_error'] is None and r['graph_bitwise_equal'] is True
            assert 1 <= r['n_sets'] <= 4 and 1 <= r['k'] <= 256 and r['per_call_ms_estimate'] > 0
            t = w.ok('sample', cell=mode, n=3)['times_ms']
            assert all(x > 0 for x in t)
            # k was calibrated on graph replays (device time), so a sample lasts about sample_ms
            assert r['k'] == 256 or r['k'] * min(t) >= 0.3 * 0.2, (r, t)
            e = w.ok('eager', cell=mode, n=2)
            assert all(0 < h <= wl for h, wl in zip(e["host_ms"], e["wall_ms"], strict=True))
            w.ok('dump', cell=mode, path=str(tmp_path / f'{mode}.pt'))
            assert w.ok('compare', cell=mode, ref=str(tmp_path / f'{mode}.pt'), tol=1e-2)['match'] is True
            # the same results through CUDA IPC handles, mapped by another process on this GPU
            c.ok('setup', cell=cell(mode, mode=mode, dtype='bfloat16', shape=shape, k=r['k']))
            for mutated in (False, True):
                d = w.ok('dump', cell=mode, share=True, mutated=mutated)
                assert d['shared'] and 'path' not in d
                m = c.ok('compare', cell=mode, shared=d['shared'], mutated=mutated, tol=0.0)
                assert m['match'] is True and 'shared_error' not in m, m
                assert w.ok('unshare')['unshared'] is True
            d = w.ok('dump', cell=mode, share=True, mutated=True)
            assert c.ok('compare', cell=mode, shared=d['shared'], tol=1e-3)['match'] is False
            # more placements of the cell: own inputs and graph memory, each proven, each timed
            p = w.ok('setup', cell=cell(mode, mode=mode, dtype='bfloat16', shape=shape, k=r['k'], placements=3))
            assert p['placements'] == 3 and p['placement_bytes'] > 0, p
            for i in range(4):  # placement 3 is placement 0 again
                assert w.ok('sample', cell=mode, n=1, placement=i)['times_ms'][0] > 0
            w.ok('release', cell=mode)
            c.ok('release', cell=mode)
        r = w.ok('setup', cell=cell('eager', mode='fwdbwd', dtype='bfloat16', shape=shape, timer='eager', k=4))
        assert r['timer'] == 'cuda_eager' and r['k'] == 4 and r['capture_error'] is None
        r = s.ok('setup', cell=cell('sync', mode='fwdbwd', dtype='bfloat16', shape=shape))
        assert r['timer'] == 'cuda_eager' and r['capture_error'], r
        assert all(x > 0 for x in s.ok('sample', cell='sync', n=2)['times_ms'])
    finally:
        w.close()
        c.close()
        s.close()


@pytest.mark.gpu
@cuda
def test_gpu_l2_states_hot_one_set_cold_flushes_in_the_graph_and_subtracts_them(tmp_path):
    tree = make_tree(tmp_path / 'gpu')
    w = Driver(tree, 'toy_op', 'base', device='cuda')
    try:
        shape = {'B': 2, 'T': 256, 'H': 4, 'D': 64}
        times = {}
        for state in ('hot', 'cold', 'rotate'):
            r = w.ok('setup', cell=cell(state, mode='fwdbwd', dtype='bfloat16', shape=shape, l2=state, placements=2))
            assert r['timer'] == 'cuda_graph' and r['capture_error'] is None and r['l2'] == state, r
            assert (r['n_sets'] == 1) if state == 'hot' else (r['n_sets'] > 1), r  # these sets fit the L2
            assert (r['flush_ms'] or 0) > 0 if state == 'cold' else r['flush_ms'] is None
            times[state] = sorted(t for i in range(4) for t in w.ok('sample', cell=state, placement=i)['times_ms'])
            assert all(t > 0 for t in times[state]), (state, times[state])
            w.ok('release', cell=state)
        # a flushed L2 cannot make the call much faster than a warm one
        assert times['cold'][2] > 0.9 * times['hot'][2], times
        r = w.ok('setup', cell=cell('cold-eager', mode='fwd', dtype='bfloat16', shape=shape, l2='cold', timer='eager', k=3))
        assert r['timer'] == 'cuda_eager' and r['flush_ms'] is None
        assert all(t > 0 for t in w.ok('sample', cell='cold-eager', n=3)['times_ms'])
    finally:
        w.close()


def test_fixture_trees_differ(trees):
    # guard against the constant patching in make_tree silently doing nothing
    src = (trees['off'] / 'toyop' / 'ops' / 'scale' / '__init__.py').read_text()
    assert 'FACTOR = 1.01' in src and 'EXTRA = True' in src


def test_a_lean_import_serves_the_packages_literal_constants_and_runs_it_for_anything_else(tmp_path):
    """`--import lean`: the op's parent packages run their __init__ only when asked for a name they
    define by running; FLA's fla/utils reads `from fla import __version__` (H200, 2026-11-30: the
    lean import failed on it)."""
    import sys
    from types import SimpleNamespace

    from flaloop.inside.worker import op_import

    pkg = tmp_path / "leanpkg"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.5.2"\nimport os\nRAN = os.getpid()\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "modules").mkdir()
    # a sibling package whose __init__ needs what this machine lacks (FLA's fla/modules needs einops)
    (pkg / "modules" / "__init__.py").write_text("import a_module_that_is_not_installed\n")
    (pkg / "modules" / "norm.py").write_text("def norm():\n    return 'n'\n")
    (pkg / "ops" / "op.py").write_text("from leanpkg import __version__\nfrom leanpkg.modules.norm import norm\n\n"
                                       "def op():\n    return __version__ + norm()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        op_import.LAZY_RAN.clear()
        mod, fn = op_import.import_op(SimpleNamespace(import_path="leanpkg.ops.op", func_name="op", name="op"),
                                   lean=True, tree=str(tmp_path))
        assert fn() == "0.5.2n" and op_import.LAZY_RAN == []  # no package __init__ ran
        assert not hasattr(sys.modules["leanpkg"], "__wrapped__") and op_import.LAZY_RAN == []
        assert sys.modules["leanpkg"].RAN > 0 and op_import.LAZY_RAN == ["leanpkg"]  # a real name runs it
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "leanpkg" or n.startswith("leanpkg.")]:
            del sys.modules[name]
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, op_import.LeanFinder)]
        op_import.LAZY_RAN.clear()
