//! The requests a push endpoint receives, described in the OpenAPI document's `webhooks`
//! section (one per format), so that an endpoint's author can generate a server stub and
//! check a request against it.
//!
//! May import: as the rest of `http`.

use serde::Serialize;
use utoipa::openapi::path::{OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{OneOfBuilder, SchemaFormat};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, HttpMethod, KnownFormat, ObjectBuilder, OpenApi, PathItem,
    PathsBuilder, Ref, RefOr, Required, Schema, Type,
};
use utoipa::{PartialSchema, ToSchema};

use super::dto::MessageDto;

/// A batch push (`batch` above 1, json format).
#[derive(Serialize, ToSchema)]
pub(crate) struct PushBatchDto {
    /// The messages, in stream order, each as `POST /fetch` returns it.
    messages: Vec<MessageDto>,
}

/// What a 2xx answer to a batch push may say of each message, in request order; without
/// it, a 2xx acks them all.
#[derive(Serialize, ToSchema)]
#[schema(example = json!({"results": [{"settle": "ack"}, {"settle": "nak", "delay_ms": 5000}, {"settle": "term", "reason": "bad order"}]}))]
pub(crate) struct PushResultsDto {
    results: Vec<PushResultDto>,
}

/// One message's settle in a batch answer.
#[derive(Serialize, ToSchema)]
pub(crate) struct PushResultDto {
    /// `ack`, `nak` or `term`.
    settle: String,
    /// For `nak`: redeliver after this many milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    delay_ms: Option<u64>,
    /// For `term`: the reason recorded with it (and on its dead letter).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    reason: Option<String>,
}

fn string() -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String)
}

fn header(name: &str, required: bool, description: &str) -> utoipa::openapi::path::Parameter {
    ParameterBuilder::new()
        .name(name)
        .parameter_in(ParameterIn::Header)
        .required(if required {
            Required::True
        } else {
            Required::False
        })
        .description(Some(description))
        .schema(Some(string()))
        .build()
}

/// The headers every push carries.
fn common_headers() -> Vec<utoipa::openapi::path::Parameter> {
    vec![
        header(
            "webhook-id",
            true,
            "`<stream>:<stream_sequence>`: the same for every attempt of a message (a batch: its first message's); the endpoint's deduplication key",
        ),
        header("webhook-timestamp", true, "Unix seconds of this attempt"),
        header(
            "webhook-signature",
            false,
            "With a `signing_secret_file`: `v1,<base64 HMAC-SHA256 of \"{webhook-id}.{webhook-timestamp}.{body}\">`, one per secret, space-separated (Standard Webhooks)",
        ),
        header(
            "Ruststream-Lease-Id",
            true,
            "The lease id (a batch: its first message's): settle it through `POST /messages/{id}/…` after answering `Ruststream-Settle: later`",
        ),
        header(
            "Ruststream-Delivered",
            true,
            "The delivery attempt, from 1 (a batch: its first message's)",
        ),
        header(
            "traceparent",
            false,
            "W3C trace context, when tracing is on",
        ),
    ]
}

/// How the endpoint's answer is read: the same for every format.
fn answers(operation: OperationBuilder, batch: bool) -> OperationBuilder {
    let settle_header = utoipa::openapi::header::HeaderBuilder::new()
        .schema(Some(string()))
        .description(Some(
            "Optional, on any status: `ack`, `nak`, `nak; delay=<ms>`, `term`, `term; reason=<text>`, or on a 2xx `later` (the lease stays open for the endpoint to settle); a value the gateway cannot read is a nak with the backoff, never an ack",
        ))
        .build();
    let mut success = ResponseBuilder::new()
        .description("Taken: the message is acked (unless `Ruststream-Settle` says otherwise)")
        .header("Ruststream-Settle", settle_header.clone());
    if batch {
        success = success.content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(PushResultsDto::name())))
                .build(),
        );
    }
    let retry_after = utoipa::openapi::header::HeaderBuilder::new()
        .schema(Some(string()))
        .description(Some(
            "Seconds or an HTTP date: no request reaches the endpoint before then (capped at `retry_after_max`)",
        ))
        .build();
    operation
        .response("200", success.build())
        .response(
            "204",
            ResponseBuilder::new()
                .description("Taken: the message (every message of a batch) is acked")
                .header("Ruststream-Settle", settle_header)
                .build(),
        )
        .response(
            "422",
            ResponseBuilder::new()
                .description("Poison (also 400, 413, 415): terminated with reason `push: HTTP <status>`, never retried")
                .build(),
        )
        .response(
            "429",
            ResponseBuilder::new()
                .description("Overloaded (also 503): nak'd with the longer of `Retry-After` and the backoff; the window halves")
                .header("Retry-After", retry_after)
                .build(),
        )
        .response(
            "500",
            ResponseBuilder::new()
                .description("Any other status (and a timeout or a failed connection): nak'd with the backoff; redirects are never followed")
                .build(),
        )
}

fn webhook(id: &str, summary: &str, body: RequestBodyBuilder, batch: bool) -> PathItem {
    let mut parameters = common_headers();
    if id == "pushCloudEvents" {
        for (name, description) in [
            ("ce-specversion", "`1.0`"),
            ("ce-id", "The webhook-id"),
            ("ce-source", "`/streams/<stream>`"),
            ("ce-type", "The subject"),
            ("ce-time", "published_at (RFC 3339)"),
        ] {
            parameters.push(header(name, true, description));
        }
    }
    if id != "pushJson" {
        for (name, description) in [
            ("Ruststream-Subject", "The message's subject"),
            ("Ruststream-Stream", "Its stream"),
            ("Ruststream-Stream-Sequence", "Its stream sequence"),
            (
                "Ruststream-Published-At",
                "When it was published (RFC 3339)",
            ),
        ] {
            parameters.push(header(name, id == "pushBinary", description));
        }
    }
    let operation = OperationBuilder::new()
        .operation_id(Some(id))
        .summary(Some(summary))
        .tag("push")
        .parameters(Some(parameters))
        // The gateway authenticates itself to the endpoint by its signature (and any static
        // headers of the push table), not by a scheme of this API.
        .securities(Some(vec![
            utoipa::openapi::security::SecurityRequirement::default(),
        ]))
        .request_body(Some(body.required(Some(Required::True)).build()));
    PathItem::new(HttpMethod::Post, answers(operation, batch).build())
}

/// Add the push requests to `spec`'s `webhooks`, and their schemas to its components.
pub(crate) fn declare(spec: &mut OpenApi) {
    let message: RefOr<Schema> = Ref::from_schema_name(MessageDto::name()).into();
    let batch: RefOr<Schema> = Ref::from_schema_name(PushBatchDto::name()).into();
    let bytes = || {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
    };
    let json = RequestBodyBuilder::new()
        .description(Some(
            "One message as `POST /fetch` returns it, or `{\"messages\": […]}` for a batch",
        ))
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(OneOfBuilder::new().item(message).item(batch)))
                .build(),
        );
    let raw = |what: &str| {
        RequestBodyBuilder::new().description(Some(what)).content(
            "application/octet-stream",
            ContentBuilder::new().schema(Some(bytes())).build(),
        )
    };
    let webhooks = PathsBuilder::new()
        .path(
            "pushJson",
            webhook("pushJson", "A push, format json", json, true),
        )
        .path(
            "pushBinary",
            webhook(
                "pushBinary",
                "A push, format binary",
                raw("The message's exact bytes; `Content-Type` is its own, or application/octet-stream; its headers that are valid HTTP headers pass through"),
                false,
            ),
        )
        .path(
            "pushCloudEvents",
            webhook(
                "pushCloudEvents",
                "A push, format cloudevents (CloudEvents 1.0, HTTP binary content mode)",
                raw("The message's exact bytes (the event's data); a message published as a binary-mode CloudEvent passes through with its own `ce-*` headers"),
                false,
            ),
        );
    spec.webhooks = Some(webhooks.build());
    let components = spec.components.take().unwrap_or_default();
    spec.components = Some(
        ComponentsBuilder::from(components)
            .schema(PushBatchDto::name(), PushBatchDto::schema())
            .schema(PushResultsDto::name(), PushResultsDto::schema())
            .schema(PushResultDto::name(), PushResultDto::schema())
            .build(),
    );
}
