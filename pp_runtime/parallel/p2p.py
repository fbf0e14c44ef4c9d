"""Activations between pipeline stages, timed as wait and transfer separately.

Each TP rank sends only its 1/tp slice of the hidden states [T, hidden / tp] to the same
TP rank of the next stage, which all-gathers the slices inside its TP group: tp times fewer
bytes cross the inter-node link than if every rank sent the whole tensor. Receivers size
their buffers from the micro-batch (T tokens), so no shape message is needed.

A one-element header (the micro-batch id) goes first: the time until it arrives is the
wait for the previous stage (a bubble, `Op.RECV_WAIT`), the time from it to the gathered
activations is the transfer (`Op.TRANSFER`). A blocking receive alone would mix the two.
The header also checks that both sides agree on which micro-batch this is. A slice of at
most `ONE_MESSAGE_BYTES` (a decode micro-batch's) travels in the header's own message
(`[8 header bytes | slice bytes]`, one uint8 buffer): one send and one receive instead of
two, whose second round trip cost more than the bytes (1.2-1.9 ms a receive on two
shared cores, docs/distributed.md); its transfer is then inside the wait, the TRANSFER
span only the check and the all-gather. Both sides decide from the micro-batch's token
count. On the sending side, the time blocked until the next stage took the previous send
is back-pressure (`Op.SEND_WAIT`). The caller's `SpanRecord` takes the spans (`telemetry/timer.py`):

- gloo (CPU): every wait blocks the host; spans are host times. A gloo send moves only
  once its receive is posted, so the receive of the next header is posted as soon as one
  is in (`StageLink.ahead`): the previous stage's send is taken while this stage computes
  (that round trip cost ~3.5 ms a micro-batch on two shared cores, docs/distributed.md).
  Every header message is then `FIXED_BYTES`, and `close` ends the receive posted ahead.
- NCCL (GPU): `recv`, `all_gather` and a send's `work.wait()` return at once and make the
  current stream wait for NCCL's stream; spans are events on the current stream, so they
  measure how long the *stream* was held: from being free for this micro-batch until the
  header had arrived, then until the activations were gathered; after computing, until
  the previous send had completed. The header is copied to pinned host memory without
  waiting and checked after the call's timing has resolved (`check_headers`): nothing
  in a receive waits on the host.

`warm_up` exchanges one element with each neighbour before the first micro-batch, so that
creating NCCL's communicators does not land in the first micro-batch's wait.
"""
from __future__ import annotations

from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pp_runtime.core.batch import MicroBatch
from pp_runtime.parallel.groups import StageGroups
from pp_runtime.telemetry.timer import Op, SpanRecord

ONE_MESSAGE_BYTES = 64 << 10  # a slice up to this size rides in the header's message
HEADER_BYTES = 8  # the micro-batch id, one int64
FIXED_BYTES = HEADER_BYTES + ONE_MESSAGE_BYTES  # gloo: every header message (posted ahead)
END = -1  # the header of a clean close's last message (gloo)


class StageLink:
    def __init__(self, groups: StageGroups, hidden: int, dtype: torch.dtype, device: torch.device):
        self.g, self.hidden, self.dtype, self.device = groups, hidden, dtype, device
        self.width = hidden // groups.tp  # one TP rank's slice of the activations
        self._pending: list = []  # (work, tensor) of sends in flight: tensors kept alive
        self._headers: list = []  # CUDA: (pinned host copy of a header, the id expected)
        # gloo: the next header's receive is posted as soon as this one is in (`ahead`), so
        # the previous stage's send is taken while this stage computes; every header
        # message is then of one size (`FIXED_BYTES`), whatever the micro-batch
        self.ahead = device.type == "cpu"
        self._next: tuple | None = None  # (work, buffer) of the receive posted ahead
        self._sent = 0  # messages of headers sent (a clean close ends them with END)

    def _check(self, got: int, want: int) -> None:
        if got != want:
            raise RuntimeError(f"stage {self.g.stage} tp rank {self.g.tp_rank}: expected "
                               f"micro-batch {want}, the previous stage sent {got}")

    def check_headers(self) -> None:
        """CUDA: check the headers received in this call, after the stream has passed them
        (the caller's timing resolved): no host sync on a receive."""
        for host, want in self._headers:
            self._check(int(host[0]), want)
        self._headers.clear()

    def recv(self, mb: MicroBatch, rec: SpanRecord) -> torch.Tensor:
        """The previous stage's activations [T, hidden]; spans RECV_WAIT and TRANSFER."""
        nbytes = mb.num_tokens * self.width * self.dtype.itemsize
        one = nbytes <= ONE_MESSAGE_BYTES
        if self.ahead:
            with rec.span(Op.RECV_WAIT):
                work, buf = self._next if self._next is not None else self._post()
                self._next = None
                work.wait()
        else:
            buf = torch.empty(HEADER_BYTES + (nbytes if one else 0), dtype=torch.uint8,
                              device=self.device)  # [8 (+ slice bytes)]
            with rec.span(Op.RECV_WAIT):
                dist.recv(buf, src=self.g.prev_rank)
        with rec.span(Op.TRANSFER):  # starts where the wait ended, on host and stream alike
            header = buf[:HEADER_BYTES].view(torch.long)
            if self.device.type == "cuda":  # read once the call's timing has resolved
                host = torch.empty(1, dtype=torch.long, pin_memory=True)
                self._headers.append((host.copy_(header, non_blocking=True), mb.mb_id))
            else:
                self._check(int(header.item()), mb.mb_id)
            if one:
                part = buf[HEADER_BYTES:HEADER_BYTES + nbytes].view(self.dtype).view(
                    mb.num_tokens, self.width)
            else:
                part = torch.empty(mb.num_tokens, self.width, dtype=self.dtype,
                                   device=self.device)  # [T, hidden / tp]
                dist.recv(part, src=self.g.prev_rank)
            if self.ahead:  # after the slice's own message: messages match in order
                self._next = self._post()
            if self.g.tp > 1:
                parts = [torch.empty_like(part) for _ in range(self.g.tp)]
                dist.all_gather(parts, part.contiguous(), group=self.g.tp_group)
                return torch.cat(parts, dim=1)  # [T, hidden]
            return part

    def send(self, mb: MicroBatch, hidden: torch.Tensor, rec: SpanRecord) -> None:
        """Send this rank's slice of hidden [T, hidden] onward without waiting for it to be
        taken. One send may be outstanding: first wait until the previous micro-batch's send
        was taken (gloo and NCCL sends complete only when the receiver posts its receive);
        that wait is the SEND_WAIT span: back-pressure from the next stage."""
        with rec.span(Op.SEND_WAIT):
            self.flush()
        part = hidden.narrow(1, self.g.tp_rank * self.width, self.width)  # [T, hidden / tp]
        nbytes = part.numel() * part.element_size()
        one = nbytes <= ONE_MESSAGE_BYTES
        size = FIXED_BYTES if self.ahead else HEADER_BYTES + (nbytes if one else 0)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)  # [8 (+ slice bytes)]
        buf[:HEADER_BYTES].view(torch.long).fill_(mb.mb_id)  # no host copy on CUDA
        if one:
            buf[HEADER_BYTES:HEADER_BYTES + nbytes].view(part.dtype).view(part.shape).copy_(part)
        msgs = (buf,) if one else (buf, part.contiguous())
        for t in msgs:
            self._pending.append((dist.isend(t, dst=self.g.next_rank), t))
        self._sent += 1

    def _post(self) -> tuple:
        """gloo: post the receive of the next header message (`ahead`)."""
        buf = torch.empty(FIXED_BYTES, dtype=torch.uint8, device=self.device)
        return dist.irecv(buf, src=self.g.prev_rank), buf

    def close(self) -> None:
        """A clean shutdown, every rank at once: with receives posted ahead, the next stage's
        is ended by an `END` header and this stage's own taken; then the sends are waited
        for (`flush`), so no message or receive is left in flight."""
        if self.ahead and self.g.next_rank is not None and self._sent:
            end = torch.empty(FIXED_BYTES, dtype=torch.uint8, device=self.device)
            end[:HEADER_BYTES].view(torch.long).fill_(END)
            self._pending.append((dist.isend(end, dst=self.g.next_rank), end))
            self._sent = 0
        if self._next is not None:
            work, buf = self._next
            self._next = None
            work.wait()
            got = int(buf[:HEADER_BYTES].view(torch.long)[0])
            if got != END:
                raise RuntimeError(f"stage {self.g.stage} tp rank {self.g.tp_rank}: closing, "
                                   f"the previous stage sent micro-batch {got} nobody ran")
        self.flush()

    def flush(self) -> None:
        """Wait until earlier sends have been taken (their buffers may then be freed). On
        NCCL the current stream waits, not the host."""
        for work, _ in self._pending:
            work.wait()
        self._pending = []


def warm_up(groups: StageGroups, device: torch.device) -> list[str]:
    """Before the first micro-batch: one all-reduce in this stage's TP group, then one
    element from the previous stage and one to the next (same TP rank), each checked.
    NCCL creates a communicator on a group's or a pair's first call, and that can take
    hundreds of ms; gloo pays little, but runs the same code. Receiving before sending
    keeps the chain free of deadlock: stage 0 only sends, and stage s receives from s - 1
    before it sends to s + 1. Returns what was exchanged, e.g. ["all_reduce tp=2",
    "recv from 0", "send to 4"]."""
    done = []
    ones = torch.ones(1, dtype=torch.long, device=device)
    dist.all_reduce(ones, group=groups.tp_group)
    if int(ones.item()) != groups.tp:
        raise RuntimeError(f"warm-up: stage {groups.stage}'s TP group summed {int(ones.item())}, "
                           f"expected tp={groups.tp}")
    done.append(f"all_reduce tp={groups.tp}")
    if groups.prev_rank is not None:
        got = torch.empty(1, dtype=torch.long, device=device)
        dist.recv(got, src=groups.prev_rank)
        if int(got.item()) != groups.prev_rank:
            raise RuntimeError(f"warm-up: rank {groups.rank} expected rank {groups.prev_rank}, "
                               f"got {int(got.item())}")
        done.append(f"recv from {groups.prev_rank}")
    if groups.next_rank is not None:
        mine = torch.full((1,), groups.rank, dtype=torch.long, device=device)
        dist.send(mine, dst=groups.next_rank)
        if device.type == "cuda":  # the send was only queued: finish it before returning
            torch.cuda.synchronize(device)
        done.append(f"send to {groups.next_rank}")
    return done


class TokenHop:
    """The token hop (docs/distributed.md, "Tokens skip the driver"): the last stage's TP
    rank 0 sends each sampling micro-batch's ids straight to stage 0, whose ranks each
    receive their own copy, so a decode planned before its token came back
    (`MicroBatch.placeholders`) needs no round trip through the driver.

    One message per micro-batch that samples, in micro-batch order: int64 [mb id, one id per
    sampling sequence in plan order (`core.batch.sampling_ids`)], on a group of its own
    (stage 0's ranks and the last stage's TP rank 0), so that on NCCL the hop never queues
    behind the activations on the same pair's stream. Stage 0 knows which micro-batches
    sample (it ran them first), so no size message is needed: it posts each receive once it
    has run the micro-batch (`irecv`: the ids land while it computes the next ones) and
    waits lazily: a micro-batch's placeholders wait on the messages in order until the one
    they name is in (a wait on its own group's receive: on NCCL no other stream stalls); the
    messages of micro-batches older than `horizon` (`cfg.in_flight`: their results are
    back at the driver, so they were sent) are taken and dropped, so none piles up. Every
    rank creates the group, in the same order (`StageWorker`'s constructor)."""

    def __init__(self, groups: StageGroups, device: torch.device, horizon: int,
                 timeout_s: float):
        tp, pp = groups.tp, groups.pp
        self.device, self.horizon = device, horizon
        self.last, self.firsts = (pp - 1) * tp, list(range(tp))  # global ranks
        self.group = dist.new_group([*self.firsts, self.last],  # a wait: step_timeout_s
                                    timeout=timedelta(seconds=timeout_s))
        self.sends = groups.stage == pp - 1 and groups.tp_rank == 0
        self.receives = groups.stage == 0
        self.expected: deque[tuple[int, object, torch.Tensor]] = deque()  # (mb id, work,
        #                                   buffer) of receives stage 0 posted, not waited for
        self.tokens: dict[int, list[int]] = {}  # mb id -> its sampled ids, received
        self.rows: dict[int, dict[int, int]] = {}  # mb id -> request id -> index in its message
        self._pending: list = []  # (work, tensor) of sends in flight
        self.last_ran = -1  # the last micro-batch stage 0 ran (ids rise within one run)

    # ---- the last stage --------------------------------------------------------------
    def send(self, mb_id: int, ids: list[int]) -> None:
        """Send a micro-batch's sampled ids (plan order) to every stage-0 rank; no wait."""
        msg = torch.tensor([mb_id, *ids], dtype=torch.long, device=self.device)  # [1 + n]
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]
        for dst in self.firsts:
            self._pending.append((dist.isend(msg, dst=dst, group=self.group), msg))

    # ---- stage 0 ---------------------------------------------------------------------
    def expect(self, mb_id: int, request_ids: list[int]) -> None:
        """Stage 0 ran micro-batch `mb_id`, whose sequences of `request_ids` sample: its
        message will come, after those of the micro-batches before it."""
        if request_ids:
            buf = torch.empty(1 + len(request_ids), dtype=torch.long, device=self.device)
            self.expected.append((mb_id, dist.irecv(buf, src=self.last, group=self.group), buf))
            self.rows[mb_id] = {r: i for i, r in enumerate(request_ids)}

    def token(self, src: int, request_id: int) -> int:
        """The id micro-batch `src` sampled for `request_id`: messages are received in
        order until src's is in (blocking: its wait is a dependency bubble)."""
        while src not in self.tokens:
            if not self.expected or self.expected[0][0] > src:
                raise RuntimeError(f"token hop: stage 0 waits for micro-batch {src}'s tokens, "
                                   f"but does not expect them (next expected: "
                                   f"{self.expected[0][0] if self.expected else None})")
            self._receive()
        return self.tokens[src][self.rows[src][request_id]]

    def before(self, mb_id: int) -> None:
        """Before stage 0 runs `mb_id`: take the messages no placeholder can still name
        (micro-batches at least `horizon` older: sent already) and forget them. An id not
        above the last one run means a new run on the same workers (a new engine numbers
        its micro-batches from 0, `benchmarks/steady_state.py` runs many on one pipeline):
        the previous run ended with every result back, so every message still due was
        sent; take them all and start afresh."""
        if mb_id < self.last_ran or mb_id == 0 <= self.last_ran:
            while self.expected:
                self._receive()
            self.tokens.clear()
            self.rows.clear()
        self.last_ran = mb_id
        oldest = mb_id - self.horizon
        while self.expected and self.expected[0][0] < oldest:
            self._receive()
        for old in [k for k in self.tokens if k < oldest]:
            del self.tokens[old], self.rows[old]

    def _receive(self) -> None:
        mb_id, work, buf = self.expected.popleft()
        work.wait()
        got = buf.tolist()
        if got[0] != mb_id:
            raise RuntimeError(f"token hop: stage 0 expected micro-batch {mb_id}'s tokens, "
                               f"the last stage sent {got[0]}'s")
        self.tokens[mb_id] = got[1:]

    def close(self) -> None:
        """At a clean shutdown: stage 0 takes every message still due, the last stage
        waits until its sends were taken (both sides at once, so neither hangs)."""
        while self.receives and self.expected:
            self._receive()
        for work, _ in self._pending:
            work.wait()
        self._pending = []
