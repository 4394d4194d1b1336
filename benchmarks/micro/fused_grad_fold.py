"""Fold the fresh-gradient copy into the compiled step?  Standalone experiment (issue 29; the figures: docs/fused_optimizer.md).

Per step, 2000 params of 64x64 float32, one thread, CPU clock, variants round-robin, median of --steps:
  kept        compiled update over flat p/g/state; gradients already in the flat grad (the memory-limit reference)
  copy        today's path: fresh grads -> torch.cat(grads, out=flat_grad) (as grads.py), then the compiled update
  cat         compiled fn(flat p/state, *fresh grads): g = cat(grads) inside the graph, then the same update
  cat_pw      as cat, torch._inductor.config.force_pointwise_cat (and max_pointwise_cat_inputs raised)
  inviews     compiled fn(per-parameter views of flat p/state as inputs, *fresh grads): each updated in place
  views       compiled fn(flat p/state, *fresh grads): update each parameter's slice of the flat buffers in place
  outcat      compiled fn returning new flat p/state: cat of per-parameter updated pieces (no copy back; buffers swap)
  real_kept / real_copy   fuse_optimizer(..., compile=True) itself (Adam only; Lion too), gradients kept / fresh
"""
import argparse, os, signal, sys, time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch
import torch._dynamo
import torch._inductor.config as icfg

N, SHAPE = int(os.environ.get("FOLD_N", 2000)), (64, 64)
NUMEL = SHAPE[0] * SHAPE[1]


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_optimizer import Lion, _with_new_grads, time_round_robin  # noqa: E402 - the fused-optimizer benchmark's


# ---- the update, written once, applied to flat tensors or to slices of them ----
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.0
LB1, LB2, LWD = 0.9, 0.99, 0.01


def adam_upd(p, g, st, step, lr):  # torch.optim.Adam (non-capturable, tensor step) formula
    m, v = st
    m.lerp_(g, 1 - B1)
    v.mul_(B2).addcmul_(g, g, value=1 - B2)
    bc1 = 1 - B1 ** step
    bc2 = 1 - B2 ** step
    denom = (v.sqrt() / bc2.sqrt()).add_(EPS)
    p.sub_((lr / bc1) * m / denom)


def adam_new(p, g, st, step, lr):  # out of place: returns new (p, m, v)
    m, v = st
    m2 = m + (g - m) * (1 - B1)
    v2 = v * B2 + g * g * (1 - B2)
    bc1 = 1 - B1 ** step
    bc2 = 1 - B2 ** step
    return p - (lr / bc1) * m2 / (v2.sqrt() / bc2.sqrt() + EPS), m2, v2


def lion_upd(p, g, st, step, lr):
    (m,) = st
    p.mul_(1 - lr * LWD)
    p.sub_(lr * (m * LB1 + g * (1 - LB1)).sign())
    m.mul_(LB2).add_(g, alpha=1 - LB2)


def lion_new(p, g, st, step, lr):
    (m,) = st
    p2 = p * (1 - lr * LWD) - lr * (m * LB1 + g * (1 - LB1)).sign()
    return p2, m * LB2 + g * (1 - LB2)


# first calls before timing: fuse_optimizer steps eagerly once and compiles at its 2nd; the others compile at the 1st
N_FIRST = 2
UPD = {"adam": (adam_upd, adam_new, 2), "lion": (lion_upd, lion_new, 1)}


def make_grads(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(N)]


def start_params():
    return torch.randn(N * NUMEL, generator=torch.Generator().manual_seed(0))


class Flat:
    """Flat p, state (zeros), step and lr as tensors."""

    def __init__(self, nstate):
        self.p = start_params()
        self.st = [torch.zeros(N * NUMEL) for _ in range(nstate)]
        self.g = torch.zeros(N * NUMEL)
        self.step = torch.zeros((), dtype=torch.float32)  # float64 add_ inside the graph is lost on this torch build
        self.lr = torch.tensor(1e-3, dtype=torch.float64)


def compile_fresh(body, variant):
    """torch.compile a copy of ``body`` with its own code object: Dynamo caches compiled code per code object, so
    variants built from the same ``def`` would otherwise share one compile (and one Inductor config)."""
    import types
    code = body.__code__.replace(co_name=f"body_{variant}")
    fn = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
    return torch.compile(fn, dynamic=False)


def build(name, variant, grads_src):
    """Return (prepare, step, params_getter) for one variant."""
    upd, new, nstate = UPD[name]
    lr = 1e-3 if name == "adam" else 1e-4
    f = Flat(nstate)
    f.lr.fill_(lr)
    holder = {"grads": None}

    def prepare():
        holder["grads"] = [g.clone() for g in grads_src]

    if variant in ("kept", "copy"):
        def body(p, g, st, step, lr):
            step += 1
            upd(p, g, st, step, lr)
        fn = compile_fresh(body, variant)
        if variant == "kept":
            torch.cat(grads_src, out=f.g.view(-1, SHAPE[1]))
            def step():
                fn(f.p, f.g, f.st, f.step, f.lr)
            return None, step, lambda: f.p
        def step():
            torch.cat(holder["grads"], out=f.g.view(-1, SHAPE[1]))  # as grads.copy_grads (one range, one cat)
            fn(f.p, f.g, f.st, f.step, f.lr)
        return prepare, step, lambda: f.p

    if variant in ("cat", "cat_pw"):
        def body(p, st, step, lr, grads):
            step += 1
            g = torch.cat([x.reshape(-1) for x in grads])
            upd(p, g, st, step, lr)
        fn = compile_fresh(body, variant)
        def step():
            fn(f.p, f.st, f.step, f.lr, holder["grads"])
        return prepare, step, lambda: f.p

    if variant == "views":
        def body(p, st, step, lr, grads):
            step += 1
            for i, x in enumerate(grads):
                a, b = i * NUMEL, (i + 1) * NUMEL
                upd(p[a:b], x.reshape(-1), [s[a:b] for s in st], step, lr)
        fn = compile_fresh(body, variant)
        def step():
            fn(f.p, f.st, f.step, f.lr, holder["grads"])
        return prepare, step, lambda: f.p

    if variant == "inviews":
        # per-parameter views of the flat p/state handed in as inputs (aliasing, non-overlapping), updated in place
        pv = list(f.p.view(N, NUMEL).unbind(0))
        sv = [list(s.view(N, NUMEL).unbind(0)) for s in f.st]
        def body(ps, sts, step, lr, grads):
            step += 1
            for i, x in enumerate(grads):
                upd(ps[i], x.reshape(-1), [s[i] for s in sts], step, lr)
        fn = compile_fresh(body, variant)
        def step():
            fn(pv, sv, f.step, f.lr, holder["grads"])
        return prepare, step, lambda: f.p

    if variant == "outcat":
        def body(p, st, step, lr, grads):
            step = step + 1
            outs = []
            for i, x in enumerate(grads):
                a, b = i * NUMEL, (i + 1) * NUMEL
                outs.append(new(p[a:b], x.reshape(-1), [s[a:b] for s in st], step, lr))
            return step, [torch.cat([o[k] for o in outs]) for k in range(1 + nstate)]
        fn = compile_fresh(body, variant)
        def step():
            f.step, res = fn(f.p, f.st, f.step, f.lr, holder["grads"])
            f.p, f.st = res[0], res[1:]
        return prepare, step, lambda: f.p

    if variant in ("real_kept", "real_copy"):
        from bagua.torch_api.contrib import fuse_optimizer
        p0 = start_params().view(N, *SHAPE)
        params = [torch.nn.Parameter(p0[i].clone()) for i in range(N)]
        for p, g in zip(params, grads_src):
            p.grad = g.clone()
        opt = torch.optim.Adam(params, lr=lr, foreach=False) if name == "adam" else \
            Lion(params, lr=lr, weight_decay=LWD)
        opt = fuse_optimizer(opt, compile=True)
        prepare_real = _with_new_grads(opt, "fuse_step")[0] if variant == "real_copy" else None
        return prepare_real, opt.fuse_step, lambda: torch.cat([p.detach().reshape(-1) for p in params])
    raise ValueError(variant)


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--optimizers", nargs="+", default=["adam", "lion"])
    ap.add_argument("--variants", nargs="+", default=["kept", "copy", "cat", "views", "outcat", "real_kept", "real_copy"])
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cap", type=int, default=300, help="seconds allowed per compile")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    print("load average at start:", os.getloadavg(), flush=True)
    grads_src = make_grads()
    for name in args.optimizers:
        torch._dynamo.reset()
        runs, compile_s = {}, {}
        for v in args.variants:
            prepare, step, getp = build(name, v, grads_src)
            patch = {"force_pointwise_cat": True, "max_pointwise_cat_inputs": 4096,
                     "max_complex_pointwise_cat_inputs": 4096} if v == "cat_pw" else {}
            signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(args.cap)
            w0, c0 = time.perf_counter(), time.process_time()
            try:
                with icfg.patch(patch):
                    for _ in range(N_FIRST):
                        if prepare:
                            prepare()
                        step()
            except Timeout:
                print(f"{name} {v}: compile exceeded {args.cap}s, dropped", flush=True)
                continue
            except Exception as e:
                signal.alarm(0)
                print(f"{name} {v}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            signal.alarm(0)
            compile_s[v] = (time.perf_counter() - w0, time.process_time() - c0)
            print(f"{name} {v}: first call(s) {compile_s[v][0]:.1f}s wall, {compile_s[v][1]:.1f}s cpu (this proc)",
                  flush=True)
            runs[v] = (prepare, step, getp)
        ms = time_round_robin({v: (prepare, step) if prepare else step for v, (prepare, step, _) in runs.items()},
                              args.steps, args.warmup, "cpu", "cpu")
        # correctness: every variant took the same number of steps with the same gradients
        total = args.warmup + args.steps + N_FIRST
        ref = runs.get("copy") or next(iter(runs.values()))
        rp = ref[2]()
        print(f"\n{name}: {N} params of {SHAPE}, 1 thread, CPU clock, median of {args.steps} steps (ms)")
        base = ms.get("copy")
        for v in runs:
            diff = (runs[v][2]() - rp).abs().max().item()
            rel = f"  {ms[v] / base:5.2f}x copy" if base else ""
            print(f"  {v:<10} {ms[v]:8.2f} ms{rel}  steps={total}  max|p - p_copy|={diff:.2e}"
                  f"  compile {compile_s[v][0]:.1f}s", flush=True)
    print("load average at end:", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
