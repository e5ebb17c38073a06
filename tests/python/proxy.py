"""A gRPC proxy for the tests: forwards every call of shardopt.v1.Optimizer to
one server byte for byte, letting a test see and rewrite the messages on
the way. It reads the wire format itself (tag, varint, length), so it
needs no generated Python code, and it stands where an older server or
client would: it can leave out fields the other side does not know.

It forwards no metadata: the servers it fronts take no tokens."""
from concurrent import futures

import grpc

SERVICE = "shardopt.v1.Optimizer"
# Each method's shape, as proto/shardopt/v1/optimizer.proto declares it.
METHODS = {
    "CreateJob": "unary_unary",
    "Init": "stream_unary",
    "Push": "stream_unary",
    "Commit": "unary_stream",
    "Read": "unary_stream",
    "Describe": "unary_unary",
    "DropJob": "unary_unary",
    "ListJobs": "unary_unary",
    "Checkpoint": "unary_unary",
}
# Above the servers' 8 MiB --max_message_bytes: the server, not the proxy,
# is what refuses.
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _varint(buf, at):
    value, shift = 0, 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def fields(message):
    """The message's top-level fields: (number, wire type, raw bytes of the
    whole field, tag included), in wire order."""
    out, at = [], 0
    while at < len(message):
        start = at
        tag, at = _varint(message, at)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, at = _varint(message, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 2:
            length, at = _varint(message, at)
            at += length
        elif wire_type == 5:
            at += 4
        else:
            raise ValueError(f"wire type {wire_type} of field {number} is not one the proto uses")
        out.append((number, wire_type, bytes(message[start:at])))
    return out


def without_field(message, number):
    """The message with every occurrence of field `number` left out."""
    return b"".join(raw for n, _, raw in fields(message) if n != number)


class Proxy:
    """Listens on 127.0.0.1 (its `address`) and forwards to `target`.
    `requests(method, message)` and `responses(method, message)` see each
    message on its way and return what to send on (default: it)."""

    def __init__(self, target, requests=None, responses=None):
        self._requests = requests or (lambda method, message: message)
        self._responses = responses or (lambda method, message: message)
        self._channel = grpc.insecure_channel(target, options=_OPTIONS)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=_OPTIONS)
        handlers = {name: self._handler(name, shape) for name, shape in METHODS.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def _handler(self, name, shape):
        # No (de)serializers on either side: messages pass as bytes.
        call = getattr(self._channel, shape)(f"/{SERVICE}/{name}")
        up = lambda message: self._requests(name, message)  # noqa: E731
        down = lambda message: self._responses(name, message)  # noqa: E731

        def forwarding(body):
            def handle(request, context):
                try:
                    return body(request, context)
                except grpc.RpcError as e:  # the server's answer, passed on as it is
                    context.abort(e.code(), e.details())
            return handle

        if shape == "unary_unary":
            return grpc.unary_unary_rpc_method_handler(
                forwarding(lambda request, context: down(call(up(request), timeout=context.time_remaining()))))
        if shape == "stream_unary":
            return grpc.stream_unary_rpc_method_handler(forwarding(
                lambda requests, context: down(call((up(m) for m in requests), timeout=context.time_remaining()))))

        def streaming(request, context):
            try:
                for message in call(up(request), timeout=context.time_remaining()):
                    yield down(message)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())
        return grpc.unary_stream_rpc_method_handler(streaming)

    def stop(self):
        self._server.stop(grace=None)
        self._channel.close()
