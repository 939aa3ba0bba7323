"""One worker thread per pipeline stage, running a schedule's actions and handing tensors to the neighbouring stages.

:meth:`StageWorkers.run` is the one executor: given a
:data:`~lightning_mgpu.placement.planning.schedule.Schedule` and a stage program, it runs every
stage's action list in that stage's thread. For each action the program calls
``receive(action)`` (a forward's input from the previous stage, a backward's output
gradient from the next one; the first stage of the flow reads ``feed`` instead) and
``send(action, value)`` (the other way; the last stage of the flow writes ``sink``); a ``W``
action (zero-bubble's weight gradient) stays inside its stage and exchanges nothing.
Values are addressed by (kind, micro-batch), so a stage waits for exactly the value its
next action needs, whatever order the schedule gives.

If a stage fails, every stage still waiting is released (it stops with
:class:`StageAborted`), and the failure is raised as :class:`PipelineError` naming the
stage, its device and the phase.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from lightning_mgpu.placement.planning.schedule import BACKWARD, FORWARD, WEIGHT, Action, Schedule

__all__ = ["PipelineError", "StageAborted", "StageWorkers", "autocast_on", "stage_context", "thread_modes"]

Receive = Callable[[Action], Any]
Send = Callable[[Action, Any], None]
StageProgram = Callable[[int, list[Action], Receive, Send], None]
"""``program(stage, actions, receive, send)``: runs one stage's actions (in that stage's thread)."""
Move = Callable[[Any, torch.device], Any]

_PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", WEIGHT: "weight backward"}


class PipelineError(RuntimeError):
    """A stage failed; the message names the stage, its device and the phase."""


class StageAborted(Exception):
    """A stage stopped because another stage failed (that stage's error is the one reported)."""


class _Mailbox:
    """The values sent to one stage, by (kind, micro-batch); its one receiver waits for the key it needs."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._items: dict[Action, Any] = {}
        self._aborted = False

    def put(self, key: Action, value: Any) -> None:
        with self._ready:
            self._items[key] = value
            self._ready.notify()

    def get(self, key: Action) -> Any:
        with self._ready:
            while key not in self._items:
                if self._aborted:
                    raise StageAborted()
                self._ready.wait()
            return self._items.pop(key)

    def abort(self) -> None:
        with self._ready:
            self._aborted = True
            self._ready.notify_all()


class StageWorkers:
    """A thread per stage, the same one for every call: a stage's tensors are allocated and
    freed by one thread (cross-thread frees made glibc return and re-fault memory on every
    micro-batch), and its device and thread settings stay put.

    ``move(tensor, device)`` carries a value across a stage boundary.
    """

    def __init__(self, devices: Sequence[torch.device], move: Move) -> None:
        self.devices = list(devices)
        self.move = move
        self._threads: Optional[list[ThreadPoolExecutor]] = None

    def run(self, schedule: Schedule, program: StageProgram, feed: Sequence[Any], sink: list[Any]) -> None:
        """Run ``program`` for every stage on its ``schedule`` list (see the module docstring).

        ``feed[i]`` enters the pipeline for micro-batch ``i`` (at stage 0 for a forward, at the
        last stage for a backward); what leaves it lands in ``sink[i]``. One stage runs in the
        calling thread (no hand-over at all) and its errors propagate as they are.
        """
        k = len(self.devices)
        devices, move = self.devices, self.move
        mailboxes = [_Mailbox() for _ in range(k)]
        current: list[Optional[Action]] = [actions[0] if actions else None for actions in schedule]

        def receiver(j: int) -> Receive:
            def receive(action: Action) -> Any:
                current[j] = action
                if action.kind == FORWARD and j == 0 or action.kind == BACKWARD and j == k - 1:
                    return move(feed[action.microbatch], devices[j])
                return mailboxes[j].get(action)

            return receive

        def sender(j: int) -> Send:
            def send(action: Action, value: Any) -> None:
                to = j + 1 if action.kind == FORWARD else j - 1
                if not 0 <= to < k:
                    sink[action.microbatch] = value
                else:
                    mailboxes[to].put(action, None if value is None else move(value, devices[to]))

            return send

        if k == 1:
            program(0, schedule[0], receiver(0), sender(0))
            return

        def task(j: int) -> None:
            try:
                program(j, schedule[j], receiver(j), sender(j))
            except BaseException:
                for mailbox in mailboxes:
                    mailbox.abort()
                raise

        threads = self._get_threads()
        futures: list[Future[None]] = [threads[j].submit(task, j) for j in range(k)]
        errors: list[tuple[int, BaseException]] = []
        for j, future in enumerate(futures):
            try:
                future.result()
            except StageAborted:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised below with the stage named
                errors.append((j, exc))
        if errors:
            # Report the failure furthest upstream in the flow: forward flows 0 -> K-1, backward K-1 -> 0.
            backward_only = all(action.kind == BACKWARD for actions in schedule for action in actions)
            j, error = errors[-1] if backward_only else errors[0]
            failed = current[j]
            phase = _PHASE_NAMES.get(failed.kind, failed.kind) if failed is not None else "a stage"
            raise PipelineError(
                f"pipeline stage {j} on {devices[j]} failed in {phase}: {type(error).__name__}: {error}"
            ) from error

    def _get_threads(self) -> list[ThreadPoolExecutor]:
        if self._threads is None:
            self._threads = [
                ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lightning_mgpu-stage{j}")
                for j in range(len(self.devices))
            ]
        return self._threads

    def close(self) -> None:
        """Stop the threads (a later :meth:`run` starts new ones)."""
        if self._threads is not None:
            for thread in self._threads:
                thread.shutdown(wait=True)
            self._threads = None


def stage_context(device: torch.device, threads: int, modes: Optional[dict[str, Any]] = None) -> contextlib.ExitStack:
    """The settings a stage's thread runs under: ``threads`` intra-op threads on CPU, the
    current CUDA device on GPU, and the caller's grad mode and autocast (:func:`thread_modes`)."""
    stack = contextlib.ExitStack()
    if device.type == "cpu":
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        stack.callback(torch.set_num_threads, previous)
    elif device.type == "cuda":
        stack.enter_context(torch.cuda.device(device))
    if modes:
        stack.enter_context(torch.set_grad_enabled(modes["grad"]))
        for device_type, (enabled, dtype) in modes["autocast"].items():
            if enabled:
                stack.enter_context(torch.autocast(device_type=device_type, dtype=dtype))
    return stack


def thread_modes() -> dict[str, Any]:
    """Grad mode and autocast of the calling thread, to re-create in the stage workers."""
    autocast = {}
    for device_type in ("cpu", "cuda"):
        try:
            autocast[device_type] = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        except (RuntimeError, TypeError):  # pragma: no cover - older torch signatures
            continue
    return {"grad": torch.is_grad_enabled(), "autocast": autocast}


def autocast_on() -> bool:
    """Whether autocast is on in the calling thread, for any device type."""
    return any(enabled for enabled, _ in thread_modes()["autocast"].values())
