"""The lease flow through a Python client generated from openapi/openapi.json.

Run by scripts/ecosystem.sh against a live gateway (started with --ack-wait 2s) and
nats-server: publish three messages, fetch them, extend + ack the first, nak the second with
a delay, term the third; then check that the nak'd one comes back after the delay with a
higher delivery count, that the acked and termed ones never come back, and that problem+json
answers parse into the generated Problem model.

Usage: python flow.py BASE_URL TOKEN   (the generated package `ruststream_nats_client` on
sys.path; TOKEN a bearer token with every scope)
"""

import sys
import time
import uuid

import httpx
from ruststream_nats_client import AuthenticatedClient, Client
from ruststream_nats_client.api.leases import (
    ack_message,
    ack_messages,
    extend_lease,
    fetch_messages,
    fetch_named_messages,
    nak_message,
    term_message,
)
from ruststream_nats_client.api.messages import publish_message
from ruststream_nats_client.api.operations import get_consumer, get_readiness, list_consumers
from ruststream_nats_client.models import (
    BatchAckBody,
    Encoding,
    ExtendResponse,
    FetchBody,
    FetchResponse,
    NakBody,
    Problem,
    PublishBody,
    PublishResponse,
    TermBody,
)

NAK_DELAY_MS = 1500
ACK_WAIT_S = 2.0


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def fetch_ours(client, token, wait_ms=1000):
    """One fetch; the messages of this run (others' are nak'd back at once)."""
    reply = fetch_messages.sync_detailed(
        client=client, body=FetchBody(batch=10, wait_ms=wait_ms, encoding=Encoding.UTF8)
    )
    check(reply.status_code == 200, f"fetch: {reply.status_code} {reply.content!r}")
    check(isinstance(reply.parsed, FetchResponse), f"fetch parsed: {reply.parsed!r}")
    ours = []
    for message in reply.parsed.messages:
        if message.data.startswith(token):
            ours.append(message)
        else:
            nak_message.sync_detailed(message.id, client=client, body=NakBody(delay_ms=0))
    return ours


def expect_problem(reply, status, kind, field=None):
    check(reply.status_code == status, f"expected {status}, got {reply.status_code}: {reply.content!r}")
    check(
        reply.headers.get("content-type", "").startswith("application/problem+json"),
        f"content type {reply.headers.get('content-type')}",
    )
    problem = reply.parsed
    check(isinstance(problem, Problem), f"a Problem, got {problem!r}")
    check(problem.status == status, f"problem.status {problem.status}")
    check(problem.type_ == f"urn:ruststream-nats:problem:{kind}", f"problem.type {problem.type_}")
    check(bool(problem.title) and bool(problem.detail), f"title/detail: {problem!r}")
    if field is not None:
        check(problem.field == field, f"problem.field {problem.field!r}, want {field!r}")
    return problem


def main(base_url, bearer):
    client = AuthenticatedClient(
        base_url=base_url, token=bearer, raise_on_unexpected_status=True, timeout=httpx.Timeout(30.0)
    )
    check(get_readiness.sync_detailed(client=client).status_code == 200, "gateway not ready")
    # Without the token, a protected operation answers 401 as the spec says.
    anonymous = Client(base_url=base_url, raise_on_unexpected_status=True)
    expect_problem(get_consumer.sync_detailed(client=anonymous), 401, "unauthorized")
    token = f"py-{uuid.uuid4().hex[:12]}"

    for name in ("ack", "nak", "term"):
        reply = publish_message.sync_detailed(
            client=client, body=PublishBody(subject="orders.clients.python", data=f"{token}-{name}")
        )
        check(reply.status_code == 201, f"publish: {reply.status_code} {reply.content!r}")
        check(isinstance(reply.parsed, PublishResponse) and reply.parsed.sequence > 0, "publish answer")

    leased = {}
    deadline = time.monotonic() + 10
    while len(leased) < 3 and time.monotonic() < deadline:
        for message in fetch_ours(client, token):
            leased[message.data.removeprefix(f"{token}-")] = message
    check(sorted(leased) == ["ack", "nak", "term"], f"fetched {sorted(leased)}")
    check(all(m.delivered == 1 for m in leased.values()), "first deliveries")

    extended = extend_lease.sync_detailed(leased["ack"].id, client=client)
    check(extended.status_code == 200 and isinstance(extended.parsed, ExtendResponse), "extend")
    check(ack_message.sync_detailed(leased["ack"].id, client=client).status_code == 204, "ack")
    # The same settle again answers as the first time did.
    check(ack_message.sync_detailed(leased["ack"].id, client=client).status_code == 204, "ack again")
    naked_at = time.monotonic()
    reply = nak_message.sync_detailed(leased["nak"].id, client=client, body=NakBody(delay_ms=NAK_DELAY_MS))
    check(reply.status_code == 204, f"nak: {reply.status_code} {reply.content!r}")
    reply = term_message.sync_detailed(leased["term"].id, client=client, body=TermBody(reason="bad order"))
    check(reply.status_code == 204, f"term: {reply.status_code} {reply.content!r}")

    # Bad calls answer problem+json that the generated model parses.
    expect_problem(ack_message.sync_detailed("not-a-lease", client=client), 404, "lease-not-found")
    expect_problem(nak_message.sync_detailed(leased["ack"].id, client=client), 409, "lease-settled")
    expect_problem(
        fetch_messages.sync_detailed(client=client, body=FetchBody(batch=0)), 422, "invalid-request", "batch"
    )

    # The nak'd message comes back after its delay with delivered 2; nothing else of ours does.
    again = None
    deadline = time.monotonic() + 15
    while again is None and time.monotonic() < deadline:
        for message in fetch_ours(client, token):
            check(message.data == f"{token}-nak", f"{message.data} came back after ack/term")
            again = message
    elapsed = time.monotonic() - naked_at
    check(again is not None, "the nak'd message did not come back")
    check(elapsed >= NAK_DELAY_MS / 1000 - 0.1, f"redelivered after {elapsed:.2f}s, before the delay")
    check(again.delivered == 2, f"redelivery count {again.delivered}")
    check(again.id != leased["nak"].id, "a redelivery has a new lease id")
    batch = ack_messages.sync_detailed(client=client, body=BatchAckBody(ids=[again.id]))
    check(batch.status_code == 200, f"batch ack: {batch.status_code}")
    check([r.status for r in batch.parsed.results] == [204], f"batch results {batch.parsed.results}")

    # Past one more ack_wait nothing of ours is redelivered: the acks and the term held.
    quiet_until = time.monotonic() + ACK_WAIT_S + 0.5
    while time.monotonic() < quiet_until:
        stray = fetch_ours(client, token, wait_ms=500)
        check(not stray, f"redelivered after being settled: {[m.data for m in stray]}")
    consumer = get_consumer.sync_detailed(client=client)
    check(consumer.status_code == 200, "consumer")

    # A named consumer (the consumers file's ORDERS/clients, filter orders.named.>), fetched
    # by name and acked through the same settle route.
    reply = publish_message.sync_detailed(
        client=client, body=PublishBody(subject="orders.named.python", data=f"{token}-named")
    )
    check(reply.status_code == 201, f"publish: {reply.status_code} {reply.content!r}")
    named = None
    deadline = time.monotonic() + 10
    while named is None and time.monotonic() < deadline:
        reply = fetch_named_messages.sync_detailed(
            "ORDERS",
            "clients",
            client=client,
            body=FetchBody(batch=10, wait_ms=1000, encoding=Encoding.UTF8),
        )
        check(reply.status_code == 200, f"named fetch: {reply.status_code} {reply.content!r}")
        for message in reply.parsed.messages:
            if message.data == f"{token}-named":
                named = message
            else:
                nak_message.sync_detailed(message.id, client=client, body=NakBody(delay_ms=0))
    check(named is not None and named.consumer == "clients", f"named lease: {named!r}")
    check(ack_message.sync_detailed(named.id, client=client).status_code == 204, "named ack")
    listed = list_consumers.sync_detailed(client=client)
    check(listed.status_code == 200, f"list consumers: {listed.status_code}")
    names = {(c.name, c.source) for c in listed.parsed.consumers}
    check({("ecosystem", "default"), ("clients", "file")} <= names, f"consumers {names}")
    expect_problem(
        fetch_named_messages.sync_detailed("ORDERS", "nobody", client=client, body=FetchBody(wait_ms=0)),
        404,
        "consumer-not-found",
    )
    print(f"python client flow: ok ({token}; nak'd message back after {elapsed:.2f}s, delivered 2)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
