"""RemoteAdamW's watch over its params: that they are the ones its job was
made with (same tensors, shapes, dtypes, devices, groups and fixed
hyperparameters), that none was changed in place outside step(), which
the servers' master would overwrite, and that none the job does not hold
has a gradient. A mixin of RemoteAdamW (shardopt.torch), whose tensors,
client and groups it uses."""
import torch

from ._checks import _as_float32, _check_betas, _in_batches, _some_names
from ._errors import InvalidArgument, ParamsChanged


class _ParamWatch:
    def _note_versions(self):
        """Remembers each param's version counter (bumped by every in-place
        change) once the optimizer has written or sent it."""
        for t in self._remote:
            t.version = getattr(t.param, "_version", None)
            t.data_ptr = t.param.data_ptr()

    def _check_unchanged(self):
        """A param changed in place since the optimizer last wrote or sent it
        (model.load_state_dict after the optimizer was built, say) would be
        overwritten with the servers' master at the next commit. Before the
        job's first step, one process sends the new values as the master
        (several ranks must agree on them: they raise); after it,
        ParamsChanged. Values equal to the master (its bf16 rounding for bf16
        params) are kept, before and after."""
        changed = [t for t in self._remote
                   if (t.version is not None and t.param._version != t.version) or t.param.data_ptr() != t.data_ptr]
        if not changed:
            return
        first = self._client.step_count == 0
        # Values written back as they were (an EMA swapped in and out, the
        # master copied back after a ParamsChanged) are not a change.
        differ = self._differing_from_master(changed)
        if differ and first and self.world_size == 1:
            self._init_values([(t, t.param, None) for t in differ])
            differ = []
        if differ:
            names = _some_names(t.name for t in differ)
            how = ("load the model before constructing RemoteAdamW on every rank" if first else
                   "to train from other values, load them before constructing the optimizer (a new job), or "
                   "load a state dict into a new job with load_state_dict()")
            raise ParamsChanged(f"params {names} changed outside step() since the servers took them (e.g. "
                                f"model.load_state_dict after the optimizer was built); the servers' master would "
                                f"overwrite them at the next step: {how}")
        self._note_versions()

    def _refuse_gradients_of_frozen(self):
        """A gradient of a param frozen when the optimizer was made (unfrozen
        since) has nowhere to go: its job holds no state of it."""
        for t in self._tensors:
            if t.frozen and t.param.grad is not None:
                raise InvalidArgument(
                    f"param {t.name!r} has a gradient, but it had requires_grad=False when this optimizer was made, "
                    "so its job holds no state of it (a job's params are fixed when it is made): to train a param "
                    "later, make the optimizer while it is trainable and freeze it after (requires_grad_(False); "
                    "zero_grad() then leaves it no gradient, and it does not step); or set its grad to None")

    def _differing_from_master(self, tensors):
        """Those of `tensors` whose param does not hold the servers' master
        (bf16 params: its rounding), bit for bit. The masters are read many
        tensors a call (an EMA swapped in changes every param)."""
        differ = []
        for batch in _in_batches(tensors, lambda t: 4 * t.numel):
            for t, master in zip(batch, self._read_masters(batch)):
                ours = t.param.detach().to("cpu").contiguous()
                if t.dtype == torch.float32:
                    same = torch.equal(master.view(torch.int32), ours.view(torch.int32))
                else:
                    same = torch.equal(master.to(torch.bfloat16).view(torch.int16), ours.view(torch.int16))
                if not same:
                    differ.append(t)
        return differ

    def _check_params(self):
        k = 0
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                t = self._tensors[k] if k < len(self._tensors) else None
                if t is None or p is not t.param or t.group != gi:
                    raise ParamsChanged("the optimizer's params changed since its job was created; build a new "
                                        "optimizer (and job) for a different set of params")
                if p.shape != t.shape or p.dtype != t.dtype or p.device != t.device:
                    raise ParamsChanged(f"param {t.name!r} is now {p.dtype} {tuple(p.shape)} on {p.device}; its job "
                                        f"has {t.dtype} {tuple(t.shape)} on {t.device}")
                k += 1
            _check_betas(g["betas"], f"group {gi}: ")  # before _group_hyper unpacks them
            if self._group_hyper(g) != self._hyper[gi]:
                raise InvalidArgument(f"group {gi}'s (beta1, beta2, eps, weight_decay) changed to "
                                      f"{self._group_hyper(g)}; the servers hold {self._hyper[gi]}, fixed at creation "
                                      "(only lr may change between steps)")
        if k != len(self._tensors):
            raise ParamsChanged("the optimizer's params changed since its job was created")
        changed = self._precision_changed()
        if changed is not None:
            gi, asked = changed
            raise InvalidArgument(f"group {gi}'s state_precision changed to {asked!r}; the servers hold "
                                  f"{self._precisions[gi]!r}, fixed at creation")

    def _precision_changed(self):
        """(index, state_precision asked for) of the first group asking for
        another precision than the servers hold, fixed at creation; None if
        every group asks for its own."""
        for gi, g in enumerate(self.param_groups):
            asked = g.get("state_precision", self._state_precision)
            if asked != self._precisions[gi]:
                return gi, asked
        return None

    @staticmethod
    def _group_hyper(g):
        """The group's numbers as the servers hold them: eps as a float32,
        so that one written again as its float32 (numpy's, say) is no
        change."""
        b1, b2 = g["betas"]
        return (float(b1), float(b2), _as_float32(g["eps"]), float(g["weight_decay"]))
