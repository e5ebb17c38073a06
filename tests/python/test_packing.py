"""Small tensors go several to a push message (GradChunk.more), and only to a
server that says it reads them (CreateJobResponse.takes_packed_grads): an
older server would drop packed chunks unread and the push would end
incomplete. Seen on the wire, through proxies in front of the two servers,
one of which leaves the field out of its answers as an older server would."""
import torch

from shardopt.torch import RemoteAdamW
from models import same_bits
from proxy import Proxy, fields, without_field

TAKES_PACKED_GRADS = 14  # CreateJobResponse
MORE = 14                # GradChunk
# Many tensors far smaller than a message, so that packing has something to do.
SIZES = [1 + (37 * i) % 300 for i in range(48)]
STEPS = 3


def train(servers, job):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    opt = RemoteAdamW(params, servers=servers, job=job, lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    opt.drop()
    return [p.detach().clone() for p in params]


def test_gradients_are_packed_only_for_a_server_that_says_it_takes_them(servers, job):
    packed = {"older": [], "newer": []}  # per push message: whether it packs chunks

    def watch(server):
        def requests(method, message):
            if method == "Push":
                packed[server].append(any(n == MORE for n, _, _ in fields(message)))
            return message
        return requests

    def as_older(method, message):
        return without_field(message, TAKES_PACKED_GRADS) if method == "CreateJob" else message

    older = Proxy(servers[0], requests=watch("older"), responses=as_older)
    newer = Proxy(servers[1], requests=watch("newer"))
    try:
        proxied = train([older.address, newer.address], f"{job}-proxied")
    finally:
        older.stop()
        newer.stop()
    direct = train(servers, f"{job}-direct")

    # The newer server was sent packed messages (so the watch sees them),
    # the older none, though it was sent many tensors' chunks.
    assert any(packed["newer"])
    assert not any(packed["older"])
    assert len(packed["older"]) > 2 * STEPS, "the older server's tensors should have taken several messages a step"
    # And the steps are the same, bit for bit, as with both servers packed.
    for i, (a, b) in enumerate(zip(proxied, direct)):
        assert same_bits(a, b), f"param {i} of {SIZES[i]} elements"
