"""Threads for sync handlers. Daemon threads, unlike ThreadPoolExecutor's (joined at exit):
a sync handler still running after drain_timeout has been nak'd and must not keep the
process from exiting."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable


class DaemonPool(Executor):
    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                      | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, (lambda: fn(*args, **kwargs)), ()))
        with self._lock:
            if self._idle <= 0 and len(self._threads) < self._size:
                thread = threading.Thread(target=self._work, name="ruststream-handler",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._idle -= 1
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, call, _ = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as error:  # handed to the worker, as an executor does
                    future.set_exception(error)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._jobs.put(None)
