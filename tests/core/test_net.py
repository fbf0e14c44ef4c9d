"""free_port never hands out one of Ray's fixed default ports (CI once drew 52365 for a
dashboard, and Ray refused to start: its agent listens there by default)."""
import socket

from pp_runtime.core import net


class _FakeSocket:
    """A socket whose kernel-chosen ports come from a list, in order."""
    ports: list = []

    def __init__(self, *args):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, addr):
        self.port = _FakeSocket.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_ray_default_port_is_drawn_again(monkeypatch):
    _FakeSocket.ports = [52365, 8265, 6379, 40001]
    monkeypatch.setattr(net.socket, "socket", _FakeSocket)
    assert net.free_port() == 40001
    assert _FakeSocket.ports == []


def test_a_real_port_is_free_and_not_a_ray_default():
    port = net.free_port()
    assert port not in net.RAY_DEFAULT_PORTS
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
