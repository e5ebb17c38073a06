"""RemoteAdamW's state_dict() and load_state_dict(): torch.optim.AdamW's
layout, read from and written to the servers in fp32. A mixin of RemoteAdamW
(shardopt.torch), whose state it uses: its tensors, groups, client and
locks."""
import hashlib
import math
import warnings

import torch

from . import _C
from ._checks import _check_hyper, _host_fp32, _in_batches, _some_names
from ._errors import FailedPrecondition, InvalidArgument, UnsupportedDtype

# torch.optim.AdamW's group keys that say how it ran its step, not what its
# state is.
_HOW_TORCH_STEPPED = ("capturable", "differentiable", "foreach", "fused")
# A param's Adam state in torch.optim.AdamW's layout: all of it, or none.
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def _number(x):
    """A state dict's number, which torch may keep as a one-element tensor."""
    return x.item() if isinstance(x, torch.Tensor) else x


def _sampled_digest(loads, samples=4096):
    """A digest of what a load would send: each tensor's name and Adam step,
    and up to `samples` evenly spaced values of each of its arrays."""
    h = hashlib.sha256()
    for t, master, moments in loads:
        h.update(f"{t.name}:{None if moments is None else moments[2]}".encode())
        arrays = [t.param if master is None else master] + ([] if moments is None else list(moments[:2]))
        for a in arrays:
            flat = a.detach().reshape(-1)
            picked = flat[::max(1, flat.numel() // samples)]
            h.update(picked.to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


class _StateDictIO:
    def state_dict(self):
        """torch.optim.AdamW's layout, read from the servers: per param
        ``step``, ``exp_avg``, ``exp_avg_sq``, plus ``master``, all fp32 (for
        bf16 params too), and ``master_step``, the Adam step of that master
        (an int, which torch's load keeps as it is and its step leaves
        behind: see load_state_dict()). Params that never had a step have no state, as in
        torch (but for moments this process loaded at step 0), and neither
        have params with zero elements. One step's state:
        read between this process's steps, and refused if the job stepped
        meanwhile all the same (another process stepping it): Aborted from a
        read that saw two steps, FailedPrecondition if it stepped between
        reads. Each group records its
        state precision ("state_precision"), the constructor's where the
        group set none, so that load_state_dict() into a job holding state
        at another precision is refused."""
        with self._step_lock:
            self._check_params()
            adam_steps = self._client.adam_steps()
            state = self._read_state(dict(zip((t.name for t in self._remote), adam_steps)))
            # The read is of one step (or Aborted), but a step applied after
            # adam_steps() and before it (another process committing a step
            # this one pushed with overlap=True) would pair the state with
            # older Adam steps; every applied step advances some tensor's.
            if self._client.adam_steps() != adam_steps:
                raise FailedPrecondition("the job stepped while its state was read; call state_dict() between "
                                         "steps")
        groups, k = [], 0
        for g, precision in zip(self.param_groups, self._precisions):
            saved = {key: value for key, value in g.items() if key != "params"}
            saved["state_precision"] = precision
            saved["params"] = list(range(k, k + len(g["params"])))
            k += len(g["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def _init_values(self, values, share=(0, 1)):
        """Each (t, master, moments) of `values` to the servers: t's master
        from `master` (fp32 exactly, or bf16), and where moments is not None,
        its (exp_avg, exp_avg_sq, Adam step); all of it, or this rank's share
        (index, count) of it. Many tensors a call: a call each cost about
        0.5 ms of round trips and thread switches."""
        for batch in _in_batches(values, lambda v: 4 * v[0].numel * (1 if v[2] is None else 3)):
            hosts, sent = [], []
            for t, master, moments in batch:
                host = master.detach().to("cpu").contiguous()
                if host.dtype not in (torch.float32, torch.bfloat16):
                    raise UnsupportedDtype(f"initial values of {t.name!r} are {host.dtype}; fp32 or bf16 needed")
                hosts.append(host)  # alive until sent
                exp_avg, exp_avg_sq, step = (0, 0, 0) if moments is None else \
                    (moments[0].data_ptr(), moments[1].data_ptr(), moments[2])
                sent.append((t.name, host.data_ptr(), host.dtype == torch.float32, exp_avg, exp_avg_sq, step))
            self._client.init_many(sent, *share)

    def _read_state(self, steps):
        state, reads = {}, []
        for k, t in enumerate(self._tensors):
            if steps.get(t.name, 0) == 0 and t.name not in self._zero_step_moments:
                continue
            entry = {"step": torch.tensor(float(steps[t.name])), "master_step": steps[t.name]}
            for key, what in (("exp_avg", _C.StateToRead.EXP_AVG), ("exp_avg_sq", _C.StateToRead.EXP_AVG_SQ),
                              ("master", _C.StateToRead.MASTER)):
                entry[key] = torch.empty(t.shape, dtype=torch.float32)
                reads.append((t.name, what, 0, t.numel, entry[key].data_ptr()))
            state[k] = entry
        # In one call, not one per tensor: a read each cost about 0.4 ms of
        # round trips and thread switches, 1.2 s for a state dict of 1000.
        self._client.read_many(reads)
        return state

    def load_state_dict(self, state_dict, shared=False):
        """Loads a state dict of this class or of torch.optim.AdamW into the
        servers, exactly: fp32 state stays fp32 whatever the params' dtype.
        A trainer that attached to a job that has stepped already has the
        servers' state (see resumed_step): the state dict of that step then
        only sets the param groups' keys (lr, as a resumed scheduler needs),
        and one of any other step is FailedPrecondition. The params are set
        from the master (for a torch.optim.AdamW state dict, which has none,
        the master is the params' current values, so load the
        model's state_dict first). A master whose ``master_step`` is not its
        entry's ``step`` is of an older step than the moments: the dict went
        through torch.optim.AdamW, which keeps the key but trains the params
        and not it. It is left out with a warning, and the params' current
        values are the master, as for a torch dict. (A dict without
        ``master_step``, as state_dict() wrote before it had one, has its
        master taken as it is.) Everything is checked before anything is
        sent. The params are set once all is sent: a load that fails while
        sending leaves them as they were, and the servers holding some of
        the state (drop the job and load again).

        By default every caller sends all of the state, so it is right
        whichever ranks call it. shared=True is for every rank of world_size
        calling it with the same state dict, joined by torch.distributed (as
        under DDP): each sends only its 1/world_size share, so the servers
        take the state once instead of once per rank, and it returns once
        every share is in: the ranks exchange their outcomes
        (all_gather_object), and if one rank's share failed every other
        raises FailedPrecondition naming it. The ranks first check together
        that torch.distributed's ranks are theirs, and raise ValueError
        alike if not."""
        self._check_params()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        if any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                             "optimizer's group")
        # Keys that say how torch ran its step (a capturable one, say), not
        # what the state is: a torch.optim.AdamW state dict keeps them, and
        # they are neither checked nor taken into the groups.
        saved_groups = [{key: value for key, value in saved.items() if key not in _HOW_TORCH_STEPPED}
                        for saved in saved_groups]
        for gi, (saved, hyper) in enumerate(zip(saved_groups, self._hyper)):
            _check_hyper({**self.param_groups[gi], **saved}, f"group {gi}: ")
            theirs = self._group_hyper({**self.param_groups[gi], **saved})
            if theirs != hyper:
                raise InvalidArgument(f"group {gi}: the state dict's (beta1, beta2, eps, weight_decay) {theirs} "
                                      f"differ from the job's {hyper}; construct RemoteAdamW with the same ones")
            precision = saved.get("state_precision", self._precisions[gi])
            if precision != self._precisions[gi]:
                raise InvalidArgument(f"group {gi}: the state dict's state_precision {precision!r} differs from the "
                                      f"job's {self._precisions[gi]!r}; construct RemoteAdamW with the same one, "
                                      "or delete the key from the state dict's param_groups to load its state into "
                                      "this precision (rounded to bf16, or widened to fp32)")
        if self._client.step_count != 0:
            return self._take_groups_of_held_state(state_dict, saved_groups)
        # Each tensor's master (None: the params' values) and, if saved, its
        # moments and Adam step, checked and in fp32; kept until sent, since
        # the client reads them by address.
        loads, stale = [], []
        for t, entry in self._entries(state_dict, saved_groups):
            master = entry.get("master")
            if master is not None and "master_step" in entry and "step" in entry \
                    and _number(entry["step"]) != _number(entry["master_step"]):
                stale.append((t.name, _number(entry["master_step"]), _number(entry["step"])))
                master = None
            master = None if master is None else self._checked(master, t, "master")
            moments = None
            missing = [key for key in _ADAM_STATE if key not in entry]
            if 0 < len(missing) < len(_ADAM_STATE):
                raise ValueError(f"the state of {t.name!r} has no {' or '.join(missing)}: a param's Adam state "
                                 "is step, exp_avg and exp_avg_sq together (or none, for one that never "
                                 "stepped)")
            if not missing:
                step = _number(entry["step"])
                # A count of updates: the servers' bias corrections take whole
                # steps, up to 2^53 (checked here, as the state goes in
                # several calls: a refusal in a later one would come after
                # the first were sent).
                if not (math.isfinite(step) and 0 <= step <= 2**53 and step == int(step)):
                    raise ValueError(f"the state of {t.name!r} has step {step}; a step is a whole number from 0 "
                                     "to 2^53")
                moments = (self._checked(entry["exp_avg"], t, "exp_avg"),
                           self._checked(entry["exp_avg_sq"], t, "exp_avg_sq"), int(step))
            loads.append((t, master, moments))
        if stale:
            name, of, step = stale[0]
            warnings.warn(f"the state dict's master of {_some_names(n for n, _, _ in stale)} is older than its "
                          f"moments ({name!r}: master of Adam step {of}, moments of step {step:g}): the dict went "
                          "through torch.optim.AdamW, which keeps master but does not update it. Those params' "
                          "current values are taken as their master instead, as for a torch.optim.AdamW state "
                          "dict: load the model's state_dict first")
        # torch's load replaces the state: a param the dict has no state for
        # has none after it. The servers cannot take a tensor's Adam step
        # back to 0, so state an earlier load gave them is refused here
        # rather than kept.
        held = dict(zip((t.name for t in self._remote), self._client.adam_steps()))
        for t, _, moments in loads:
            if moments is None and held.get(t.name, 0) != 0:
                raise FailedPrecondition(
                    f"param '{t.name}' has Adam state on the servers from an earlier load_state_dict (step "
                    f"{held[t.name]}), and this state dict has none for it, which the servers cannot clear: drop "
                    "the job (drop()) and construct the optimizer again, then load this state dict")
        # Moments an earlier load gave at step 0 are cleared, as torch's load
        # would leave none: at step 0 zeros are no state.
        loads = [(t, master, (torch.zeros(t.numel), torch.zeros(t.numel), 0)
                  if moments is None and t.name in self._zero_step_moments else moments)
                 for t, master, moments in loads]
        for t, master, moments in loads:
            self._check_initial(t, t.param if master is None else master, "master")
            if moments is not None:
                self._check_initial(t, moments[0], "exp_avg")
                self._check_initial(t, moments[1], "exp_avg_sq")
        share = self._load_share(loads) if shared else (0, 1)
        error = None
        try:
            self._init_values([(t, t.param if master is None else master, moments) for t, master, moments in loads],
                              share)
            for t, master, _ in loads:
                if master is not None:
                    with torch.no_grad():  # bf16: rounded to nearest even, as the servers round
                        t.param.copy_(master.view(t.shape))
        except Exception as e:  # noqa: BLE001 (shared: the other ranks must hear of it first)
            if not shared:
                raise
            error = e
        if shared:
            # Every share is in once every rank says so. At a barrier, a rank
            # that failed and lived on would be waited for until the process
            # group's timeout; here every rank learns each one's outcome, and
            # all raise if any failed.
            outcomes = [None] * self.world_size
            torch.distributed.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
            if error is not None:
                raise error
            for r, why in enumerate(outcomes):
                if why is not None:
                    raise FailedPrecondition(f"load_state_dict(shared=True): rank {r} could not send its share "
                                             f"({why}); the job's state is incomplete: drop the job and load again")
        self._take_group_keys(saved_groups)
        # State at Adam step 0 (moments given with step 0) is the servers'
        # like any other, but their Adam step does not say so: state_dict()
        # shows it from this set until the tensor steps.
        self._zero_step_moments = {t.name for t, _, moments in loads if moments is not None and moments[2] == 0
                                   and (moments[0].any() or moments[1].any())}
        self._note_versions()

    def _take_groups_of_held_state(self, state_dict, saved_groups):
        """A job that has stepped: the servers hold its state, and a
        restarted trainer resumes from them. A state dict of that very state
        (every tensor's Adam step the servers') gives the groups its lr and
        other keys, as torch's load does, so that a resumed loop (with its
        scheduler's load_state_dict) steps at the lr it left off at; any
        other is refused, since its state cannot replace the servers'."""
        held = dict(zip((t.name for t in self._remote), self._client.adam_steps()))
        for t, entry in self._entries(state_dict, saved_groups):
            step = _number(entry.get("step", 0))
            step = int(step) if float(step).is_integer() else step  # torch keeps it as a float
            if step != held.get(t.name, 0):
                raise FailedPrecondition(
                    f"the job is at step {self._client.step_count} and the servers hold its state, which this "
                    f"state dict is not (param {t.name!r} is at Adam step {step} in it, "
                    f"{held.get(t.name, 0)} on the servers): a restarted trainer resumes from the servers, and "
                    "loads only the state dict of the step they hold (for its param groups' lr); to start "
                    "from this one, drop the job and load it into a new one")
        self._check_masters_held(state_dict, saved_groups)
        self._take_group_keys(saved_groups)

    def _check_masters_held(self, state_dict, saved_groups, sample=1024):
        """The same Adam steps are not the same state: another run of the
        job's name, or a run of another job, saved at the same step would
        only have set the groups' keys, its weights and moments dropped
        unsaid. Each fp32 master the dict holds for the step it has (one
        that went through torch's steps is older and not compared) is
        compared, its first `sample` elements, bitwise with the servers'
        (one read of all of them)."""
        reads, pairs = [], []
        for t, entry in self._entries(state_dict, saved_groups):
            master = entry.get("master")
            step = _number(entry.get("step", 0))
            if (not isinstance(master, torch.Tensor) or master.dtype != torch.float32 or not t.numel
                    or master.numel() != t.numel or _number(entry.get("master_step", step)) != step):
                continue
            n = min(sample, t.numel)
            held = torch.empty(n, dtype=torch.float32)
            reads.append((t.name, _C.StateToRead.MASTER, 0, n, held.data_ptr()))
            pairs.append((t, master.detach().reshape(-1)[:n].to("cpu"), held))
        if not reads:
            return
        self._client.read_many(reads)
        for t, saved, held in pairs:
            differ = (saved.view(torch.int32) != held.view(torch.int32)).nonzero()
            if len(differ):
                i = int(differ[0])
                raise FailedPrecondition(
                    f"the job is at step {self._client.step_count} and the servers hold its state; this state dict "
                    f"is of the same Adam steps but not of that state: param {t.name!r}'s master differs from "
                    f"the servers' (element {i}: {saved[i].item()!r} in the dict, {held[i].item()!r} on the "
                    "servers), so it is another run's, saved at the same step. A restarted trainer resumes from "
                    "the servers; to start from this state dict, drop the job and load it into a new one")

    def _entries(self, state_dict, saved_groups):
        """Each param the job holds (_Tensor.remote) and its entry in the
        state dict's state ({} for none), in the groups' order: the others
        take nothing from it, neither values nor state."""
        tensors = iter(self._tensors)
        for saved in saved_groups:
            for index in saved["params"]:
                t = next(tensors)
                if t.remote:
                    yield t, state_dict["state"].get(index, {})

    def _take_group_keys(self, saved_groups):
        """The saved groups' keys but their params, as torch's load takes them."""
        for g, saved in zip(self.param_groups, saved_groups):
            g.update({key: value for key, value in saved.items() if key != "params"})

    def _load_share(self, loads):
        """This rank's share (index, count) of a shared load_state_dict, once
        every rank has seen that torch.distributed's ranks are RemoteAdamW's
        and that every rank loads the same state (`loads`, by a sample of
        it: two state dicts of one model differ nearly everywhere): raises
        ValueError on every rank if not. Each rank used to send its share of
        whatever it was given, and the servers held a mix."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("load_state_dict(shared=True) needs torch.distributed initialized on every rank")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"load_state_dict(shared=True): torch.distributed has {dist.get_world_size()} ranks, "
                             f"the job {self.world_size}")
        said = [None] * self.world_size
        dist.all_gather_object(said, (self.rank, _sampled_digest(loads)))
        ranks = [rank for rank, _ in said]
        if ranks != list(range(self.world_size)):
            raise ValueError(f"load_state_dict(shared=True): RemoteAdamW's ranks by torch.distributed rank are "
                             f"{ranks}, not 0 ... {self.world_size - 1}")
        differ = [rank for rank, digest in said if digest != said[0][1]]
        if differ:
            raise ValueError(f"load_state_dict(shared=True): rank {differ[0]} loads another state than rank 0 (its "
                             "state dict, or its model's params where the state dict has no master, differ); every "
                             "rank must load the same one. Nothing was sent")
        return (self.rank, self.world_size)

    def _check_initial(self, t, x, what):
        """The servers' checks of an initial value (finite as the group holds
        it; exp_avg_sq not negative), made here so that a state dict they
        would refuse partway is refused before anything is sent."""
        values = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
        _C.check_initial_values(t.name, values.data_ptr(), values.numel(), self._bf16_state[t.group], what)

    def _checked(self, x, t, what):
        # The param's shape, as torch's step needs: a transposed moment of
        # the same size would otherwise be read in the wrong order.
        if tuple(x.shape) != tuple(t.shape):
            raise ValueError(f"{what} of {t.name!r} has shape {tuple(x.shape)}, the param {tuple(t.shape)}")
        return _host_fp32(x, f"{what} of {t.name!r}")
