//! Case B: a provider's webhook delivery, verified and keyed by the provider's own identifier
//! (SPEC 6), then deduplicated like any other request.

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use idemgate_core::fingerprint::Fingerprint;

use super::{Call, Gateway, namespace};
use crate::access_log::AccessLog;
use crate::body::Body;
use crate::config::Route;
use crate::problem::{Kind, Problem};

impl Gateway {
    /// Case B: the provider's delivery, verified and keyed by its own identifier (SPEC 6).
    pub(super) async fn webhook(
        self: &Arc<Self>,
        route: Arc<Route>,
        req: Request<Incoming>,
        peer: SocketAddr,
        log: &mut AccessLog,
    ) -> Result<Response<Body>, Problem> {
        let unknown = || Problem::new(Kind::UnknownWebhook, "no such webhook");
        let webhooks = self.config.webhooks.clone().ok_or_else(unknown)?;
        let path = req.uri().path().to_owned();
        let params = route.path.matches(&path).ok_or_else(unknown)?;
        let webhook_id = params
            .iter()
            .find(|(n, _)| *n == "webhook_id")
            .map(|(_, v)| (*v).to_owned());
        let webhook_id = webhook_id.ok_or_else(unknown)?;
        let (parts, body) = req.into_parts();
        let body = self.read_body(body).await?;
        // Before admitting, so that a refusal is logged and counted under its provider.
        log.case = "B";
        log.source = route.provider.map_or("webhook", |p| p.as_str());
        let admitted = webhooks.admit(&route, &webhook_id, &parts, &body)?;
        log.set_principal(Some(&admitted.principal));
        let key = namespace(&route, Some(&admitted.principal), &admitted.raw_key)?;
        log.set_key(&key);
        // Keyed by the provider's delivery id alone: a redelivery is the same delivery even if
        // the provider changed a field of the payload (Stripe's `pending_webhooks`), so the body
        // is not part of the fingerprint.
        let fingerprint = Fingerprint::compute(&route.id, "WEBHOOK", &admitted.raw_key, None, b"");
        let call = Call {
            route,
            parts,
            body,
            peer,
            principal: Some(admitted.principal),
        };
        self.dedup(call, key, fingerprint, log).await
    }
}
