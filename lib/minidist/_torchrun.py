"""``launch`` under torchrun: this process is one rank; run fn here, gather all results."""

from __future__ import annotations

import faulthandler
import warnings

import torch

from . import transport as transports


def launch_under_torchrun(fn, world_size, args, kwargs, transport, timeout, device, env) -> list:
    """This process is one rank of a torchrun job: run fn here, gather all results."""
    import torch.distributed as dist

    if world_size is not None and world_size != env["world_size"]:
        raise ValueError(
            f"launch(world_size={world_size}) under torchrun, which started WORLD_SIZE="
            f"{env['world_size']} processes: pass world_size=None or make them agree"
        )
    if transport != "torch":
        warnings.warn(
            f"under torchrun ranks may be on different machines: using transport='torch' "
            f"instead of {transport!r}",
            stacklevel=3,
        )
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch_device = torch.device("cuda", env["local_rank"])
        torch.cuda.set_device(torch_device)
    comm = transports.TorchComm(
        env["rank"],
        env["world_size"],
        None,
        local_rank=env["local_rank"],
        device=torch_device,
        timeout=timeout,
    )
    if timeout is not None:  # no parent watches us: dump our stack and exit if stuck
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        value = fn(comm, *args, **kwargs)
        values: list = [None] * env["world_size"]
        dist.all_gather_object(values, value)
    finally:
        if timeout is not None:
            faulthandler.cancel_dump_traceback_later()
        comm.close()
    return values
