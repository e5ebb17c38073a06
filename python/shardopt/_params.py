"""The params as RemoteAdamW's job knows them: each one's name, group,
shape and staging buffers, the groups and names the constructor is given,
and the version bump that tells autograd a step changed them."""
import torch

from ._errors import InvalidArgument, UnsupportedDtype

# dtype -> whether the server treats the tensor as fp32 params (ParamType::kFp32).
_FP32_PARAMS = {torch.bfloat16: False, torch.float32: True}
_DEVICE_TYPES = ("cpu", "cuda")  # where _Tensor reads and writes params


class _Tensor:
    """One param as the job knows it, and its host staging buffers (only for
    params that are not contiguous host memory)."""

    __slots__ = ("name", "param", "group", "shape", "dtype", "device", "numel", "remote", "host_param", "host_grad",
                 "version", "data_ptr")

    def __init__(self, name, param, group):
        """Raises for a param the job would hold but the servers cannot take:
        a tensor subclass, a dtype but bf16 and fp32, a device but the CPU
        and CUDA."""
        # Whether the job holds it. A param with no elements has nothing to
        # optimize, and one frozen when the optimizer is made (LoRA's base
        # weights, a quantized base among them; a mask kept as a param)
        # nothing to step: torch allocates no state for a param that never
        # gets a gradient, and DeepSpeed and Megatron leave frozen params out.
        # Either stays in its group, as in torch, but the servers hold no
        # master or moments of it, and it may be of any kind. A job's params
        # are fixed when it is made, so one frozen then cannot train later
        # (step() refuses its gradient).
        numel = param.numel()
        self.remote = numel > 0 and param.requires_grad
        if self.remote and type(param) not in (torch.Tensor, torch.nn.Parameter):
            raise InvalidArgument(f"param {name!r} is a {type(param).__name__}, a tensor subclass (such as the DTensor "
                                  "of FSDP2 or tensor parallelism, or a lazy module's uninitialized param); "
                                  "RemoteAdamW takes plain tensors, whose memory holds the whole param")
        if self.remote and param.dtype not in _FP32_PARAMS:
            raise UnsupportedDtype(f"param {name!r} is {param.dtype}; RemoteAdamW takes torch.bfloat16 and "
                                   "torch.float32 params")
        if self.remote and param.device.type not in _DEVICE_TYPES:
            why = (" (a meta tensor has no values to send: materialize the model first, e.g. to_empty() then load "
                   "or initialize its weights)" if param.device.type == "meta" else "")
            raise InvalidArgument(f"param {name!r} is on {param.device}; RemoteAdamW takes params on the CPU or a "
                                  f"CUDA device{why}")
        self.name, self.param, self.group = name, param, group
        self.shape, self.dtype, self.device, self.numel = param.shape, param.dtype, param.device, numel
        self.host_param = self.host_grad = None
        self.version = None  # the param's version counter when the optimizer last wrote or sent it
        self.data_ptr = None  # and where its values were: `p.data = other` swaps them without a version bump

    @property
    def frozen(self):
        """Whether it was frozen when the optimizer was made, and is left out
        of the job for that."""
        return self.numel > 0 and not self.remote

    @property
    def fp32(self):
        return _FP32_PARAMS[self.dtype]

    def in_place(self):
        return self.param.device.type == "cpu" and self.param.is_contiguous()

    def staging(self):
        return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")


def _mark_changed(param):
    """Tells autograd that `param` changed in place, as torch's optimizers'
    own in-place writes do: a backward through a graph that saved its old
    values then raises instead of using the new ones. (The servers' values
    were written through its data pointer, which autograd does not see.) An
    in-place op on none of its elements bumps the version counter that
    every view and detach() of it shares."""
    with torch.no_grad():
        param.detach().as_strided((0,), (1,)).zero_()


def _is_named(item):
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)


def _split_names(params):
    """Param groups for torch.optim.Optimizer, and {id(param): name} when the
    params came with names (model.named_parameters(), or groups of them)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                        f"got {torch.typename(params)}")
    if isinstance(params, (set, frozenset)):
        raise TypeError("params argument should be an iterable with a fixed order (a list or a generator), not a "
                        "set: the params' order names them on the servers, and a set's differs between processes")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    names, unnamed = {}, 0
    for group in groups:
        ps = group["params"]
        if isinstance(ps, (set, frozenset)):
            raise TypeError("a param group's params should be a list (or another ordered iterable), not a set: the "
                            "params' order names them on the servers, and a set's differs between processes")
        ps = [ps] if isinstance(ps, torch.Tensor) or _is_named(ps) else list(ps)
        plain = []
        for item in ps:
            if _is_named(item):
                names[id(item[1])] = item[0]
                plain.append(item[1])
            else:
                unnamed += 1
                plain.append(item)
        group["params"] = plain
    if names and unnamed:
        raise ValueError("give every param a name (model.named_parameters()) or none")
    return groups, names
