"""Two hostile layers found by a review of assignment 8 (``make.py``: ``oracle`` and ``prefetch``).

Each replaces the solution's ``ExpertParallelMoE`` (the file's last definition) and is exact on
the output and every gradient; neither sends the tokens to the experts in the forward.

* ``ORACLE`` sends nothing: every rank reads the job's spec in its working directory, rebuilds the
  other ranks' experts, tokens and loss weights from the seeds (``seeded_`` written out here:
  importing the grader's ``seeding`` is refused) and computes everything itself; an autograd
  function that adds zero in the forward hands its local experts the other ranks' share of the
  gradient in the backward.
* ``PREFETCH`` ships every rank's experts to every rank while the layer is built, computes the
  forward locally, and sends each (token, other rank) pair's input and output gradient once in the
  backward, where the receiving rank back-propagates into its own experts.
"""

ORACLE = """
import copy
import json
import pathlib


def seeded_(model, seed):  # the grader's seeding.seeded_, written out
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for parameter in model.parameters():
            bound = 1.0 / max(1, parameter.shape[-1] if parameter.dim() > 0 else 1) ** 0.5
            draw = torch.rand(parameter.shape, generator=g, dtype=torch.float64)
            parameter.copy_(draw * (2 * bound) - bound)
    return model


def _normal(shape, *keys):
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key)) % 2**61
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _find_spec(num_experts, top_k, factor, tokens, width):
    wanted = {"experts": num_experts, "top_k": top_k, "capacity_factor": factor}
    wanted.update(tokens=tokens, width=width)
    for path in pathlib.Path(".").glob("*.json"):
        try:
            jobs = json.loads(path.read_text())["jobs"]
        except Exception:
            continue
        for job in jobs:
            spec = (job.get("args") or [{}])[0]
            if isinstance(spec, dict) and all(spec.get(k) == v for k, v in wanted.items()):
                return spec
    raise RuntimeError("no spec")


def _mix(x, router, experts, top_k, factor):
    chosen, gates, slots = route(router(x), top_k, factor)
    rows = []
    for i in range(x.shape[0]):
        total = x.new_zeros(x.shape[1])
        for j in range(top_k):
            if slots[i, j] >= 0:
                total = total + gates[i, j] * experts[int(chosen[i, j])](x[i : i + 1])[0]
        rows.append(total)
    return torch.stack(rows)


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, comm, num_experts, top_k, capacity_factor):
        super().__init__()
        self.router, self.experts, self.comm = router, nn.ModuleList(experts), comm
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def forward(self, x):
        p, rank, local = self.comm.world_size, self.comm.rank, len(self.experts)
        spec = _find_spec(self.num_experts, self.top_k, self.capacity_factor, x.shape[0], x.shape[1])
        every = []
        for e in range(self.num_experts):
            if rank * local <= e < (rank + 1) * local:
                every.append(self.experts[e - rank * local])
            else:
                twin = copy.deepcopy(self.experts[0]).float()  # built in float32, as the grader's
                twin = seeded_(twin, spec["seed"] * 31 + 2 + e).double()
                for q in twin.parameters():
                    q.requires_grad_(False)
                every.append(twin)
        y = _mix(x, self.router, every, self.top_k, self.capacity_factor)
        frozen = copy.deepcopy(self.router)  # the other ranks' losses, for the local experts
        others = x.new_zeros(())
        for q in range(p):
            if q == rank:
                continue
            xq = _normal([spec["tokens"], spec["width"]], spec["seed"], 100 + q)
            if spec.get("starved"):
                xq[:, 0] = 4.0
            wq = _normal([spec["tokens"], spec["width"]], spec["seed"], 200 + q)
            others = others + (_mix(xq, frozen, every, self.top_k, self.capacity_factor) * wq).sum()
        params = [q for e in self.experts for q in e.parameters()]
        if others.requires_grad:
            extra = torch.autograd.grad(others, params, allow_unused=True)
        else:
            extra = [None] * len(params)
        extra = [torch.zeros_like(q) if g is None else g for q, g in zip(params, extra)]

        class Inject(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                return x.new_zeros(x.shape)

            @staticmethod
            def backward(ctx, grad):
                return tuple(extra)

        return y + Inject.apply(*params)
"""

PREFETCH = """
import copy


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, comm, num_experts, top_k, capacity_factor):
        super().__init__()
        self.router, self.experts, self.comm = router, nn.ModuleList(experts), comm
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        p, rank, local = comm.world_size, comm.rank, len(experts)
        flat = torch.cat([q.detach().reshape(-1) for e in experts for q in e.parameters()])
        every = all_to_all(comm, flat.unsqueeze(0).repeat(p, 1))  # row q: rank q's experts
        self.copies = []
        for q in range(p):
            at = 0
            for j in range(local):
                twin = copy.deepcopy(experts[j])
                with torch.no_grad():
                    for t in twin.parameters():
                        t.copy_(every[q, at : at + t.numel()].view(t.shape))
                        at += t.numel()
                        t.requires_grad_(False)
                self.copies.append(experts[j] if q == rank else twin)

    def forward(self, x):
        p, rank, local, d = self.comm.world_size, self.comm.rank, len(self.experts), x.shape[1]
        chosen, gates, slots = route(self.router(x), self.top_k, self.capacity_factor)
        kept = slots >= 0
        y = x.new_zeros(x.shape)
        for j in range(self.top_k):
            for e in range(self.num_experts):
                use = torch.nonzero(kept[:, j] & (chosen[:, j] == e)).squeeze(1)
                if use.numel():
                    contribution = self.copies[e](x[use]) * gates[use, j : j + 1]
                    y = y.index_add(0, use, contribution)
        layer, comm, owner = self, self.comm, chosen // local

        class Exchange(torch.autograd.Function):
            @staticmethod
            def forward(ctx, out):
                return out.clone()

            @staticmethod
            def backward(ctx, grad):
                pieces = []
                for q in range(p):
                    mine = kept & (owner == q)
                    token = torch.nonzero(mine.any(1)).squeeze(1)
                    weight = torch.where(mine, gates.detach(), torch.zeros_like(gates))[token]
                    column = torch.where(mine, chosen - q * local, torch.zeros_like(chosen))[token]
                    weights = x.new_zeros(token.numel(), local).scatter_add(1, column, weight)
                    rows = torch.cat([x.detach()[token], grad[token], weights], dim=1)
                    pieces.append(rows if q != rank else rows[:0])
                arrived = all_to_all(comm, pieces)
                with torch.enable_grad():
                    total = None
                    for q, rows in enumerate(arrived):
                        if q == rank or not rows.shape[0]:
                            continue
                        inputs, g, w = rows[:, :d], rows[:, d : 2 * d], rows[:, 2 * d :]
                        for j, expert in enumerate(layer.experts):
                            use = torch.nonzero(w[:, j] != 0).squeeze(1)
                            if use.numel():
                                part = (expert(inputs[use]) * g[use] * w[use, j : j + 1]).sum()
                                total = part if total is None else total + part
                    if total is not None:
                        params = [t for e in layer.experts for t in e.parameters()]
                        torch.autograd.backward(total, inputs=params)
                return grad

        return Exchange.apply(y)
"""
