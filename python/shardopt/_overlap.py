"""RemoteAdamW(overlap=True): each gradient pushed while backward is still
running, from a hook on its param's AccumulateGrad node, and the push
finished and committed by step(). A mixin of RemoteAdamW (shardopt.torch),
whose state it uses: its tensors, client, order and locks."""
import gc
import time
import weakref

import torch

from . import _C
from ._checks import _some_names
from ._errors import Aborted, Error, FailedPrecondition, InvalidArgument

_ONE_GRADIENT = ("overlap pushes each gradient as backward produces it, so it takes one backward per step() and each "
                 "param's gradient whole (torch.utils.checkpoint with use_reentrant=True gives a param used in two "
                 "checkpointed segments, or in and out of one, its gradient in parts: pass use_reentrant=False; "
                 "another loss's backward that reaches these params, as a GAN's generator loss reaches the "
                 "discriminator's, pushed them too: call this optimizer's zero_grad() after it, which skips that push, "
                 "or freeze them for it); use overlap=False to accumulate gradients")

# Each param's live RemoteAdamW(overlap=True): a second one's hooks would
# fire in the same backward, and both would push that gradient. By id, as
# tensors compare by value; an entry holds both weakly, so a new param
# that reuses a dead one's id is not taken for it.
_PUSHED_BY = {}  # id(param) -> (weakref to the param, weakref to its optimizer)


def _pusher(param):
    entry = _PUSHED_BY.get(id(param))
    return entry[1]() if entry is not None and entry[0]() is param else None


def _held(tensor):
    """What a push holds of a gradient it reads by address until it ends:
    the tensor, and a view of its memory of its own, since p.grad.data = t
    lets the memory go from under the tensor."""
    return None if tensor is None else (tensor, tensor.detach())


class _Pushed:
    """A gradient as a push took it: the tensor (weakly), its version and
    the address of its memory (p.grad.data = ... swaps the memory under the
    same tensor and bumps no version)."""

    def __init__(self, g):
        self._tensor = None if g is None else weakref.ref(g)
        self._version = getattr(g, "_version", None)
        self._address = None if g is None else g.data_ptr()

    def changed(self, now):
        if self._tensor is None:
            return now is not None
        return (now is None or now is not self._tensor() or now._version != self._version
                or now.data_ptr() != self._address)


class _OverlapPush:
    def _check_params_free(self):
        """Refuses, before anything is sent, params that another live
        RemoteAdamW(overlap=True) pushes."""
        for collected in (False, True):
            taken = [t for t in self._remote if _pusher(t.param) is not None]  # the others get no hook
            if not taken or collected:
                break
            gc.collect()  # one let go of but not yet freed (a reference cycle) is no owner
        if taken:
            raise InvalidArgument(f"param {taken[0].name!r} is pushed already by another RemoteAdamW(overlap=True) "
                                  f"that is still alive (job {_pusher(taken[0].param)._job!r}): its backward "
                                  "hooks would push every gradient to both. Delete that optimizer first (with "
                                  "whatever still refers to it, such as an LR scheduler), or use overlap=False")

    def _set_order(self, order):
        self._order = order
        self._order_names = [self._tensors[k].name for k in order]
        self._position = {k: i for i, k in enumerate(order)}

    def _register_ready_hooks(self):
        # Claimed with the hooks, at the end of construction: one that failed
        # before (and that a traceback may keep alive) pushes nothing.
        for key in [k for k, (param, _) in _PUSHED_BY.items() if param() is None]:
            del _PUSHED_BY[key]  # params gone
        me = weakref.ref(self)
        for t in self._remote:
            _PUSHED_BY[id(t.param)] = (weakref.ref(t.param), me)
        # torch 1.13 has no post-accumulate-grad hook; a hook on the param's
        # AccumulateGrad node runs right after p.grad is written, on torch 1.x
        # and 2.x alike. The nodes must be kept alive for the hooks to stay.
        this = weakref.ref(self)

        def hook(k):
            def ready(grad_inputs, grad_outputs):
                optimizer = this()
                if optimizer is not None:
                    optimizer._on_grad_ready(k)
            return ready

        # A param the job does not hold (_Tensor.remote) gets no hook; one
        # frozen later gets no gradient, and step() pushes it as having none.
        # The node is found through a view made with grad enabled, also when
        # the optimizer is built under torch.no_grad().
        with torch.enable_grad():
            for k, t in enumerate(self._tensors):
                if not t.remote:
                    continue
                node = t.param.expand_as(t.param).grad_fn.next_functions[0][0]
                node.register_hook(hook(k))
                self._hooks.append(node)

    def _start_push(self):
        """Opens the push of the next step, in the order backward last gave
        the gradients."""
        self._check_unchanged()
        self._push_step = self._client.step_count + 1
        # Says nothing of how the step will be committed (GradChunk.intent):
        # its lr may still change before step(), as a loop may set it after
        # backward.
        self._client.start_push(self._push_step, self._order_names)
        self._seen, self._marked = [], {}
        self._second_gradient = None

    def _push_running(self):
        """Starts the push of the next step unless one runs: from the first
        gradient hook of a backward, or from step() where no backward
        started one (no param had a gradient, or a retry after a failed
        commit), to push what p.grad holds."""
        if not self._client.pushing():
            self._start_push()

    def _on_grad_ready(self, k):
        with self._push_lock:
            self._push_running()
        t = self._tensors[k]
        if k in self._marked:
            # torch has added it into p.grad, which the push may be reading
            # still: the push is committed as a skip (_commit_push).
            self._second_gradient = t.name
            raise FailedPrecondition(f"RemoteAdamW(overlap=True): param {t.name!r} got a second gradient before "
                                     f"step(); step {self._push_step} will be skipped: {_ONE_GRADIENT}")
        source, owner = self._grad_source(t)
        # What was pushed: a gradient changed after this (clipped, unscaled,
        # its memory swapped through p.grad.data, or set to None) would not
        # be what the servers apply (_finish_push checks). Held weakly: a
        # gradient let go is freed once the push ends.
        g = t.param.grad
        self._marked[k] = _Pushed(g)
        if t.device.type == "cuda":
            # The push reads the staging buffer as soon as it is marked.
            torch.cuda.current_stream(t.device).synchronize()
        self._client.mark(self._position[k], source, _held(owner))
        self._seen.append(k)

    def _commit_push(self, skip=False):
        """Finishes the running push and commits it, decided as
        Client::Step decides, and returns the decision; or (skip=True)
        commits it as a skipped step, and returns None. A push that a
        param's second gradient reached is committed as a skip: what it
        read of that param's p.grad may be either gradient, or both."""
        self._push_running()  # its step is the one compared with a skip owed
        if skip or self._second_gradient is not None or self._skip_owed == self._push_step:
            self._finish_push(skip=True)
            self._commit_skip()
            self._second_gradient = None
            return None
        first = None
        for retry in (False, True):
            push = self._finish_push()  # on the retry: a new push, from p.grad
            decision = _C.decide(push, self.world_size, self.max_grad_norm, 1.0)
            if first is not None and (decision.skip or decision.gscale != first.gscale):
                # The other servers may have applied the first decision.
                _C.refuse_redecided(self._push_step, first.gscale, decision)
            first = decision
            if decision.skip:
                self._commit_skip()
                return decision
            try:
                self._commit_pushed(decision.gscale)
                return decision
            except Aborted as e:
                # The other ranks' commits skipped the step (a zero_grad()
                # after their backward) before this one applied it.
                if _C.skipped_asked_applied not in e.message:
                    raise
                step = self._push_step
                self._take_servers_step(e, "skipped", "to be applied")
                raise Aborted(f"RemoteAdamW(overlap=True): this rank committed step {step} to be applied, but the "
                              f"other ranks' commits had skipped it; this rank took step {step} as the servers did "
                              f"(a skip: its params are theirs) and goes on: {e.message}") from None
            except FailedPrecondition as e:
                # A server that restarted after the push was complete was
                # given the job again and restored the step before, with no
                # push of this one. p.grad still holds what was pushed
                # (_finish_push refuses it otherwise), so it is pushed again
                # from there and committed, once.
                if retry or _C.push_incomplete(self._push_step) not in e.message:
                    raise

    def _commit_pushed(self, gscale):
        """Commits the finished push's step, not a skip, at each group's
        current lr."""
        group_lr = [float(g["lr"]) for g in self.param_groups]
        self._client.commit(self._push_step, group_lr[0], gscale, False, self._param_targets(), group_lr)

    def _commit_skip(self, tell=True):
        """Commits the finished push's step as a skip. A skip applies
        nothing, so its lr is not sent (an lr the loop has made invalid
        since does not refuse it), and what it pushed does not matter (a
        server that lost the push is pushed the step again with none:
        Client::Commit). Until it is committed on every server the step is
        owed as a skip: some servers may hold it as one, so whatever the
        next step() pushed for it is committed as a skip too
        (_commit_push). Where the other ranks' commits applied the step
        before it (this rank's loop raised after backward, the others'
        did not), the skip is refused: this rank then takes the step as the
        servers applied it, and raises Aborted once saying so (`tell`; a
        caller already raising its own error keeps that one)."""
        self._skip_owed = self._push_step
        try:
            self._client.commit(self._push_step, 0.0, 1.0, True, self._param_targets(), [])
        except Aborted as e:
            # A step applied, or being applied, by another commit
            # (rpc/skip_disagreement.h).
            if _C.applied_asked_skipped not in e.message:
                raise
            step = self._push_step
            self._take_servers_step(e, "applied", "as a skip")
            if tell:
                raise Aborted(f"RemoteAdamW(overlap=True): this rank committed step {step} as a skip, but the other "
                              "ranks' commits had applied it, with what this rank had pushed of it; this rank took "
                              f"step {step} as the servers applied it (its params are theirs) and goes on: "
                              f"{e.message}") from None
            return
        self._skip_owed = None

    def _take_servers_step(self, refused, done, asked):
        """Attaches again, once the servers hold the step as the other
        ranks' commits left it (`done`: "applied" or "skipped"; one may still
        be applying it: a few tries over about a second and a half), and
        takes their params, as a trainer that attaches does; no skip is owed
        any more. Rank 0 then takes the step's checkpoint_every checkpoint,
        which its own commit would have. `asked`: how this rank committed
        it, for the errors."""
        step, pause = self._push_step, 0.1
        for _ in range(5):
            try:
                self._client.create_or_attach(*self._attach_args, 0, None)
            except Error as e:
                raise Aborted(f"RemoteAdamW(overlap=True): step {step} was {done} by the other ranks where this "
                              f"rank committed it {asked} ({refused.message}), and attaching again to take it "
                              f"failed: {e.message}; construct the optimizer again to go on") from None
            if self._client.step_count >= step:
                break
            time.sleep(pause)
            pause *= 2
        else:
            raise Aborted(f"RemoteAdamW(overlap=True): step {step} was being {done} by the other ranks where this "
                          f"rank committed it {asked} ({refused.message}), and the servers did not finish it "
                          "within 1.5 s; call step() again")
        self._skip_owed = None
        self._pull_params()
        self._note_versions()
        self._checkpoint_if_due()

    def _changed_since_pushed(self):
        """The names of the params whose p.grad is not what the push took
        from it: another tensor, changed in place, the same tensor over
        other memory (p.grad.data = ...), or None (the servers hold its
        gradient already: they cannot leave the param alone, as torch's
        step would)."""
        return [self._tensors[k].name for k, pushed in self._marked.items()
                if pushed.changed(self._tensors[k].param.grad)]

    def _finish_push(self, skip=False):
        """Marks the gradients no hook delivered (set by hand, or None) and
        waits for the push; learns the order backward produced them in, and
        refuses gradients changed since backward pushed them. For a push
        to be committed as a skip (`skip`), whose gradients do not matter,
        the rest are marked as none and nothing is refused."""
        self._push_running()
        seen = set(self._seen)
        rest = [k for k in self._order if k not in seen]
        if skip:
            for k in rest:
                self._client.mark(self._position[k], 0, None)
            return self._client.finish_push()
        try:
            changed = self._changed_since_pushed()
            if changed:
                raise InvalidArgument(f"the gradients of {_some_names(changed)} changed after backward "
                                      "produced them (clipped, unscaled, set to None, or all-reduced by "
                                      "DistributedDataParallel?); overlap=True pushes each as it is produced: clip "
                                      "with max_grad_norm, leave the averaging over ranks to the servers (no DDP), "
                                      "zero gradients with opt.zero_grad() (which skips the step), or use "
                                      "overlap=False")
            self._refuse_gradients_of_frozen()
            sources = {k: self._grad_source(self._tensors[k]) for k in rest}
            self._sync_staging()
        except BaseException:
            # The push waits for every mark: it ends with no gradient for the
            # rest and is committed as a skip (what it pushed is not the
            # gradient), so that the optimizer is not left refusing every call.
            for k in rest:
                self._client.mark(self._position[k], 0, None)
            self._client.finish_push()
            self._commit_skip(tell=False)
            raise
        for k in rest:
            source, owner = sources[k]
            self._client.mark(self._position[k], source, _held(owner))
        push = self._client.finish_push()
        self._set_order(self._seen + rest)
        return push
