"""``RemoteAdamW``: a drop-in ``torch.optim.Optimizer`` whose state lives on
shardopt servers.

    opt = shardopt.torch.RemoteAdamW(model.named_parameters(), servers=["10.0.0.5:50051"], job="run-42", lr=3e-4)

replaces ``torch.optim.AdamW(model.parameters(), lr=3e-4)``. The servers keep
an fp32 master and fp32 moments of every param (ZeRO-style, split over the
servers) and run AdamW; ``step()`` pushes each ``p.grad`` and writes the
updated values into ``p`` in place: bf16 params get the master rounded to
nearest even, fp32 params the master itself, bit for bit.

Supported param dtypes: ``torch.bfloat16`` and ``torch.float32`` (others, fp16
included, raise ``shardopt.UnsupportedDtype``: fp16 gradients would need a loss
scale this optimizer does not manage). Params may live on the CPU (used in place)
or a CUDA device (staged through pinned host buffers, non-blocking); any other
device (meta included) raises ``shardopt.InvalidArgument``. Params whose memory
overlaps raise ValueError; views at disjoint places of one buffer are taken.
"""
import numbers
import os
import threading
import warnings

import torch

from . import _C, _attempts
from ._errors import AlreadyExists, Error, FailedPrecondition, InvalidArgument, ParamsChanged
from ._checks import _check_disjoint, _check_gradient, _check_hyper, _check_ints, _check_seconds, _raise_naming_frozen
from ._log import _log_step, _resume_lrs
from ._connect import _read_pem, _servers
from ._overlap import _OverlapPush
from ._param_watch import _ParamWatch
from ._params import _Tensor, _mark_changed, _split_names
from ._safetensors import load_safetensors
from ._state_dict import _StateDictIO

__all__ = ["RemoteAdamW", "load_safetensors"]

_STATE_PRECISIONS = ("fp32", "bf16")


class RemoteAdamW(_OverlapPush, _StateDictIO, _ParamWatch, torch.optim.Optimizer):
    """AdamW on shardopt servers, with torch.optim.AdamW's update rule.

    Args:
        params: tensors, param groups (dicts, e.g. no weight decay for norms
            and biases), or ``model.named_parameters()`` (then the servers'
            tensor names are the model's state_dict keys). Params with
            requires_grad=False here (a frozen base model, a mask kept as a
            param) stay in their groups but get no state on the servers, as
            torch allocates none for a param that never steps; they cannot
            train later in this optimizer (step() refuses their gradients):
            make it before freezing those to train later.
        servers: a list of ``host:port``, one ``host:port``, or a StatefulSet
            pattern such as ``"shardopt-{i}.shardopt:50051"`` with
            ``num_servers``. Every rank gives the same list in the same order.
        job: the job's name on the servers. A job that exists is attached to
            and resumed from the servers' state. Its settings must match
            (else AlreadyExists): world_size, the params (names, sizes,
            dtypes, groups), each group's betas, eps, weight_decay and
            state_precision, and barrier_timeout; lr, max_grad_norm,
            chunk_bytes and rpc_timeout may differ (but every rank must
            step with the same lr and max_grad_norm: a step whose ranks'
            pushes disagree on them is refused, FailedPrecondition, on every
            server, and nothing is applied).
        rank, world_size: data parallelism without DDP: every rank pushes its
            gradients, the servers average them, every rank gets the same
            params back. A new job's initial values are rank 0's params (as
            DDP broadcasts rank 0's): rank 0 sends them, and every other
            rank waits (up to ``barrier_timeout``) until they are in and
            takes them from the servers, so ranks may start from different
            params.
        lr, betas, eps, weight_decay: torch.optim.AdamW's defaults for groups
            that do not set their own.
        max_grad_norm: global-norm clipping over the averaged gradient (0 or
            None: none), decided alike on every rank from the servers'
            partial norms.
        state_precision: "fp32" (default) or "bf16" (the comparison arm:
            master and moments in bf16, as torch.optim.AdamW keeps them on
            bf16 params; not bitwise torch's: the servers' arithmetic is
            fp32 rounded once per value where torch rounds each
            operation; how far apart grows with lr: after 20 steps on 4096
            elements of randn, 1 in 205 params differed at lr 1e-4, 1 in 33
            at 1e-3, 1 in 3 at 1e-2; where |p| > 0.1 by at most 0, 2 and 7
            bf16 ulps, below it, where an ulp is tiny, by up to 18, 24 and
            193: measurements, not a bound),
            for groups that do not set their own "state_precision".
        overlap: push each gradient while backward is still running (one
            backward per step, each param's gradient whole: with
            torch.utils.checkpoint pass use_reentrant=False; do not modify
            gradients between backward and step; use max_grad_norm instead
            of clipping them yourself; not with DDP).
        rpc_timeout, max_attempts: each server call's deadline in seconds (at
            least 0.001, finite), and attempts for UNAVAILABLE,
            DEADLINE_EXCEEDED and a server's CANCELLED.
        barrier_timeout: seconds (at least 0.001, finite) the servers wait
            for every rank's gradients, and a new job's ranks wait for each
            other's initial values. Part of the job's settings: attaching
            with another one raises AlreadyExists.
        checkpoint_every: rank 0 asks for a checkpoint after every step that
            is a multiple of this (servers need --checkpoint_dir: without
            it rank 0's constructor raises FailedPrecondition), with
            overlap too; 0: only on ``checkpoint()``. If that checkpoint
            fails, ``step()`` raises its error after the step was applied and
            the params updated: do not repeat the step.
        restore_step: for servers with --checkpoint_dir that do not hold the
            job: 0 resumes from the newest checkpoint, t from step t's (an
            older t starts a new run: newer checkpoints are moved aside).
            Give t only to the launch that goes back; relaunch with 0.
        resume: None attaches to the job or creates it; False requires a
            new job (at step 0: never another run's, or a checkpoint's),
            True a job to resume (at a later step: never a fresh start where
            nothing was found). Else FailedPrecondition, and nothing kept.
        chunk_bytes: bytes of gradient per streamed message; 0 (default)
            lets the client choose from world_size (4 MiB for one or two
            ranks down to 256 KiB from 32 on: each costs every server about
            a message's worth of buffer per rank).
        tls_ca, tls_cert, tls_key: paths of PEM files; any of them turns
            TLS on. ``tls_ca`` is the CA that signed the servers'
            certificates (without it, the system's roots); ``tls_cert`` and
            ``tls_key`` are this trainer's certificate and key, given
            together, for servers started with --tls_client_ca (mutual TLS).
            An empty file, one that is not PEM text, a certificate or key
            OpenSSL cannot read (or an encrypted key), a key that is not the
            certificate's, or one of the pair alone raises InvalidArgument
            before anything connects.
        token: the bearer token for servers started with --tokens_file;
            None reads the environment variable SHARDOPT_TOKEN (unset: no
            token). Give servers TLS too, or the token crosses in the clear.
    """

    def __init__(self, params, servers, job, rank=0, world_size=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, max_grad_norm=0.0, state_precision="fp32", overlap=False, num_servers=None,
                 rpc_timeout=60.0, max_attempts=5, barrier_timeout=60.0, checkpoint_every=0, restore_step=0,
                 chunk_bytes=0, tls_ca=None, tls_cert=None, tls_key=None, token=None, resume=None, amsgrad=False,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None):
        if capturable or differentiable:
            raise ValueError("RemoteAdamW updates on the servers: capturable and differentiable are not supported")
        if max_grad_norm is None:  # as other APIs spell no clipping
            max_grad_norm = 0.0
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
            raise TypeError(f"max_grad_norm must be a number (0 or None: no clipping), not "
                            f"{type(max_grad_norm).__name__} {max_grad_norm!r}")
        if not 0.0 <= max_grad_norm < float("inf"):
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (0: no clipping)")
        if state_precision not in _STATE_PRECISIONS:
            raise ValueError(f"state_precision must be one of {_STATE_PRECISIONS}, not {state_precision!r}")
        if not isinstance(job, str) or not job:
            raise TypeError(f"job must be the job's name, a non-empty str, not {type(job).__name__} {job!r}")
        if resume is not None and not isinstance(resume, bool):
            raise TypeError(f"resume must be None, True or False, not {type(resume).__name__} {resume!r}")
        _check_ints(rank=rank, world_size=world_size, checkpoint_every=checkpoint_every, restore_step=restore_step,
                    chunk_bytes=chunk_bytes, max_attempts=max_attempts)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, not {type(overlap).__name__} {overlap!r}")
        for what, n in (("world_size", world_size), ("max_attempts", max_attempts)):
            if n < 1:
                raise ValueError(f"{what} must be at least 1, not {n}")
        for what, n in (("checkpoint_every", checkpoint_every), ("restore_step", restore_step)):
            if n < 0:
                raise ValueError(f"{what} must be at least 0 (0: {'never' if what == 'checkpoint_every' else 'the newest'}), "
                                 f"not {n}")
        _check_seconds(rpc_timeout=rpc_timeout, barrier_timeout=barrier_timeout)
        if chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be at least 0 (0: the client chooses), not {chunk_bytes}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        groups, names = _split_names(params)
        seen = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                # torch steps a param listed twice twice; the servers hold it once.
                if id(p) in seen:
                    raise ValueError(f"group {gi} lists param {names.get(id(p), f'param.{seen[id(p)]}')!r} again: "
                                     "each param may appear once")
                seen[id(p)] = len(seen)
        # torch.optim.AdamW's keys too, so that code reading them finds them;
        # foreach and fused change nothing here (the servers run one fused
        # kernel), amsgrad and maximize are refused.
        betas = tuple(betas) if isinstance(betas, list) else betas  # anything else: _check_hyper names it
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
                                      fused=fused))
        precisions = [g.get("state_precision", state_precision) for g in self.param_groups]
        for gi, (g, precision) in enumerate(zip(self.param_groups, precisions)):
            if precision not in _STATE_PRECISIONS:
                raise ValueError(f"group {gi}: state_precision must be one of {_STATE_PRECISIONS}, not {precision!r}")
            _check_hyper(g, f"group {gi}: ")

        self._tensors = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                name = names.get(id(p), f"param.{len(self._tensors)}")
                self._tensors.append(_Tensor(name, p, gi))
        self._remote = [t for t in self._tensors if t.remote]  # _Tensor.remote says which
        if not self._remote:
            raise ValueError("every param has zero elements or requires_grad=False: there is nothing to optimize")
        _check_disjoint([(t.name, t.param) for t in self._remote])
        self._hyper = [self._group_hyper(g) for g in self.param_groups]
        self.rank, self.world_size = rank, world_size
        self.max_grad_norm, self.overlap = float(max_grad_norm), overlap
        self.last_decision = None  # of the last step(): grad_norm, clip_factor, skip
        self._job = job
        if overlap:
            self._check_params_free()

        pem = [_read_pem(path, what) for path, what in ((tls_ca, "tls_ca"), (tls_cert, "tls_cert"), (tls_key, "tls_key"))]
        if token is None:
            token = os.environ.get("SHARDOPT_TOKEN", "")
        # The periodic checkpoint: after step() or a skip commit, on both paths (not Client::Step's). The
        # client's attach refuses it where a server has no --checkpoint_dir, and leaves no job behind.
        self._checkpoint_every = int(checkpoint_every)
        self._client = _C.Client(_servers(servers, num_servers), rank, max_attempts, int(rpc_timeout * 1000),
                                 chunk_bytes, self._checkpoint_every, *pem, token=token)
        self._bf16_state = [precision == "bf16" for precision in precisions]
        self._state_precision, self._precisions = state_precision, precisions
        job_groups = [(f"group.{gi}", b1, b2, eps_, wd, 1.0, precisions[gi] == "fp32")
                      for gi, (b1, b2, eps_, wd) in enumerate(self._hyper)]
        job_tensors = [(t.name, t.numel, t.group, t.fp32, list(t.shape)) for t in self._remote]
        # What attaching takes, but restore_step: an overlap optimizer
        # attaches again where its skip lost to the others' apply (_overlap.py).
        self._attach_args = (job, world_size, job_groups, job_tensors, False, int(barrier_timeout * 1000))
        #: The job's step when this optimizer attached: 0 for a new job, else
        #: the step resumed from (the params were pulled from the servers).
        try:
            self.resumed_step = self._client.create_or_attach(*self._attach_args, restore_step, resume)
        except AlreadyExists as e:
            _raise_naming_frozen(e, [t.name for t in self._tensors if t.frozen])
        if restore_step and self.resumed_step != restore_step:
            warnings.warn(f"restore_step={restore_step} was not used: the servers hold job '{job}' at step "
                          f"{self.resumed_step} (a job is restored only on servers that do not hold it; to go "
                          "back, drop it on every server first)", stacklevel=2)
        if self._client.pushed_ahead:
            ahead = self._client.pushed_ahead
            warnings.warn(f"step {ahead} of job '{job}' is pushed and not yet committed: if this process replaces a "
                          f"trainer of this rank that was killed after pushing it (or part of it), step {ahead} is "
                          "applied with that trainer's gradients where the servers hold them, not this process's "
                          "(the servers count a rank's push of a step once)", stacklevel=2)
        # A job not yet stepped that holds Adam state (a state dict was
        # loaded into it, then perhaps checkpointed and restored) keeps its
        # masters, which go with those moments: every rank takes them, as
        # at a later step, rather than rank 0 sending masters that the
        # moments were not made for.
        keeps_masters = self.resumed_step == 0 and any(self._client.adam_steps())
        if self.resumed_step == 0 and not keeps_masters:
            # Rank 0's params are the job's initial values, as DDP broadcasts
            # rank 0's: it sends them (the servers take the model's bytes
            # once), and every other rank waits until they are in and takes
            # them from the servers, so ranks built from different seeds
            # still start alike.
            if rank == 0:
                # Values there already came from an earlier launch: this
                # rank's params replace them (weights loaded since count),
                # but a rank that attached before now may have taken those.
                earlier = world_size > 1 and all(s.uninitialized_tensors == 0 for s in self._client.describe())
                self._init_values([(t, t.param, None) for t in self._remote])
                if earlier:
                    warnings.warn(f"job '{job}' held initial values from an earlier launch, and rank 0 has now sent "
                                  "its own: a rank that attached before it took the earlier ones, and its first "
                                  "step's gradients come from those weights (the ranks agree again from step 1's "
                                  "params on); start the other ranks after rank 0, or restart them too",
                                  stacklevel=2)
            self._client.wait_for_initial_values(int(barrier_timeout * 1000))
        if self.resumed_step != 0 or rank != 0 or keeps_masters:
            self._pull_params()
        self._note_versions()
        self._lrs_to_check = _resume_lrs(self)
        self._client.verify_state()

        self._hooks = []
        self._zero_step_moments = set()  # params a load gave moments at Adam step 0 (_state_dict.py)
        # Held by step() and state_dict(), which another thread may call.
        self._step_lock = threading.RLock()
        # Backward runs a model's hooks on one autograd thread per device:
        # the first to see no push running starts it, once.
        self._push_lock = threading.Lock()
        if overlap:
            # Backward runs roughly last to first.
            self._order = [k for k in reversed(range(len(self._tensors))) if self._tensors[k].remote]
            self._set_order(self._order)
            self._second_gradient = None  # the param that got one, while a push runs (_overlap.py)
            self._skip_owed = None  # a step some servers may hold as a skip (_overlap.py)
            self._register_ready_hooks()

    # ---- the torch.optim.Optimizer interface ----

    def __getstate__(self):
        raise TypeError("RemoteAdamW holds its servers' connections and cannot be pickled or copied; save "
                        "state_dict() instead (torch.save(opt.state_dict(), path))")

    def add_param_group(self, param_group):
        """Not after construction: a job's params and groups are fixed when
        it is created (raises ParamsChanged). Give every group to the
        constructor, with the params to train later trainable then (freeze
        them after construction): one with requires_grad=False at
        construction is left out of the job."""
        if getattr(self, "_client", None) is not None:
            raise ParamsChanged("RemoteAdamW's params are fixed when its job is created; build a new optimizer "
                                "(and job) for a different set of params")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Pushes every ``p.grad`` (params whose grad is None are skipped, as
        torch does), lets the servers apply AdamW at each group's current
        ``lr``, and writes the new values into the params in place."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with self._step_lock:  # a state_dict() in another thread reads between steps
            self._step()
        return loss

    def _step(self):
        self._check_params()
        for gi, g in enumerate(self.param_groups):  # the lr a scheduler set, before it is sent
            _check_hyper(g, f"group {gi}: ")
        second = self.overlap and self._second_gradient
        if self.overlap:
            decision = self._commit_push()  # None: committed as a skip
        else:
            self._check_unchanged()
            self._refuse_gradients_of_frozen()  # (overlap's _finish_push refuses them)
            group_lr = [float(g["lr"]) for g in self.param_groups]
            sources = [self._grad_source(t) for t in self._remote]
            self._sync_staging()
            decision = _attempts.step(self, sources, lambda grads: self._client.step(
                grads, self._param_targets(), group_lr[0], group_lr, self.max_grad_norm, 1.0)).decision
        # As torch's step, this one changes (and bumps the version counter
        # of) only the params with a gradient, and a skipped step none. With
        # several ranks another rank's gradient may have moved a param this
        # one has none for: all are taken as changed.
        skipped = decision is None or decision.skip
        for t in self._remote:
            if skipped or (t.param.grad is None and self.world_size == 1):
                continue
            if not t.in_place():
                t.param.copy_(t.host_param, non_blocking=True)
            else:
                _mark_changed(t.param)
        self._note_versions()
        if decision is not None:
            self.last_decision = decision
            _log_step(self, decision)
        self._checkpoint_if_due()
        if decision is None:
            why = (f"param {second!r} got a second gradient before this step() (backward raised)" if second else
                   "an earlier call began committing it as a skip and failed partway")
            raise FailedPrecondition(f"RemoteAdamW(overlap=True): {why}, so step {self._client.step_count} was "
                                     "applied as a skip: nothing moved. Call zero_grad() and run one backward per "
                                     "step()")

    def zero_grad(self, set_to_none=True):
        """torch's zero_grad, with torch 2.x's default set_to_none=True
        (torch 1.13's was False): a param whose gradient then stays None,
        one frozen mid-run, stops stepping, where a zero gradient would go
        on stepping it. With overlap=True, a push that backward began and
        no step() committed is committed first, as a skipped step."""
        # A push running here had its backward but will get no step(): it is
        # completed as a skipped step so the job can go on.
        try:
            if self.overlap and self._client.pushing():
                with self._step_lock:
                    self._commit_push(skip=True)
                    self._checkpoint_if_due()
        finally:
            # Zeroed even if that failed: a gradient left behind would be
            # summed into the next backward's and pushed with it.
            super().zero_grad(set_to_none=set_to_none)

    # ---- shardopt's own ----

    def checkpoint(self):
        """Asks the servers to write a checkpoint of the job's current step
        (servers with --checkpoint_dir). A trainer restarted later with the
        same job resumes from the servers' state, or from this checkpoint if
        the servers restarted too."""
        self._client.checkpoint()

    def _checkpoint_if_due(self):
        every = self._checkpoint_every
        t = self._client.step_count
        if every > 0 and self.rank == 0 and t % every == 0:
            try:
                self.checkpoint()
            except Error as e:
                # Said so, since the way out of a failed step(), calling it
                # again, would here apply the next step with these gradients.
                raise type(e)(f"step {t} was applied and its params are in the model (job_step is {t}; do not "
                              f"call step() again for it), but its checkpoint (checkpoint_every) failed; call "
                              f"checkpoint() for it, unless what follows says a server lost steps or its part "
                              f"(then do what it says): {e.message}") from e

    def verify_state(self):
        """Raises shardopt.FailedPrecondition if any group's state is not held
        at the precision asked for: the group's "state_precision" now, which
        the servers fixed when the job was made."""
        changed = self._precision_changed()
        if changed is not None:
            gi, asked = changed
            raise FailedPrecondition(f"group {gi} asks for state_precision {asked!r}; the servers hold its state "
                                     f"in {self._precisions[gi]!r}, fixed when the job was made")
        self._client.verify_state()

    def describe(self):
        """Each server's address, device, step, state bytes, and whether it
        has a --checkpoint_dir."""
        return self._client.describe()

    def drop(self):
        """Deletes the job and its state from the servers. This optimizer's
        later calls to them raise FailedPrecondition, other trainers' get
        NotFound. Checkpoints on disk stay: a later job of the same name on
        servers with --checkpoint_dir restores the newest complete one, so
        remove the job's directory there to start it afresh."""
        self._client.drop()

    @property
    def job_step(self):
        """The job's step as this optimizer last saw it, not asked of the
        servers (describe() asks them): the last it did or resumed at."""
        return self._client.step_count

    def master(self, param):
        """The fp32 master of one param, read from the servers."""
        return self.masters([param])[0]

    def masters(self, params):
        """The fp32 masters of `params`, a list in their order, read from
        the servers in one call (a call each costs about 0.4 ms). KeyError
        for a param of no group, or one frozen when the optimizer was made
        (but for one of no elements, whose master is an empty tensor)."""
        of = {id(t.param): t for t in self._tensors}
        tensors = [of.get(id(p)) for p in params]
        for t in tensors:
            if t is None:
                raise KeyError("not a param of this optimizer")
            if t.numel and not t.remote:
                raise KeyError(f"param {t.name!r} had requires_grad=False when this optimizer was made: the "
                               "servers hold no master of it")
        return self._read_masters(tensors)

    # ---- internals ----

    def _param_targets(self):
        return [(t.name, self._param_target(t)) for t in self._remote]

    def _param_target(self, t):
        """Where the servers' new values of t go: the param itself, or its
        staging buffer."""
        if t.in_place():
            return t.param.data_ptr()
        if t.host_param is None:
            t.host_param = t.staging()
        return t.host_param.data_ptr()

    def _grad_source(self, t):
        """The address of t's gradient as host memory of the param's dtype
        (0 for no gradient), and the tensor whose memory that is (None for
        none). CUDA gradients are copied without blocking: call
        _sync_staging before the push reads them."""
        g = t.param.grad
        if g is None:
            return 0, None
        _check_gradient(t.name, g, t.param.shape)
        if g.device.type == "cpu" and g.is_contiguous() and g.dtype == t.dtype:
            return g.data_ptr(), g
        if t.host_grad is None:
            t.host_grad = t.staging()
        t.host_grad.copy_(g, non_blocking=True)
        return t.host_grad.data_ptr(), t.host_grad

    def _sync_staging(self):
        for device in {t.device for t in self._tensors if t.device.type == "cuda"}:
            torch.cuda.current_stream(device).synchronize()

    def _read_masters(self, tensors):
        """The servers' fp32 masters of `tensors`, in one call."""
        out = [torch.empty(t.shape, dtype=torch.float32) for t in tensors]
        reads = [(t.name, _C.StateToRead.MASTER, 0, t.numel, m.data_ptr()) for t, m in zip(tensors, out) if t.numel]
        if reads:  # params with no elements ask nothing, also while a push runs or after drop()
            self._client.read_many(reads)
        return out

    def _pull_params(self):
        """Sets every param to the servers' values: the fp32 master itself, or
        its bf16 rounding."""
        self._client.read_many([(t.name, _C.StateToRead.MASTER if t.fp32 else _C.StateToRead.PARAM_BF16, 0, t.numel,
                                 target) for t, target in ((t, self._param_target(t)) for t in self._remote)])
        for t in self._remote:
            if not t.in_place():
                t.param.data.copy_(t.host_param)
