"""ruststream: a worker, a producer and a push verifier for the ruststream-nats gateway."""

from .client import Client, PublishAck
from .errors import AuthError, GatewayError, Nak, Term
from .message import Message, Settlement
from .stats import WorkerStats
from .worker import Handler, Worker

__all__ = ["AuthError", "Client", "PublishAck", "GatewayError", "Handler", "Message", "Nak", "Settlement", "Term",
           "Worker", "WorkerStats"]
__version__ = "0.1.0"
