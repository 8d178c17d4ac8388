//! The layer's refusals are byte-for-byte the gateway's (SPEC 11): same slug, title, status and
//! body shape for the same refusal.

use http_body_util::BodyExt;
use idemgate::problem::{Kind, Problem as GatewayProblem};
use tower_idemgate::{Problem, ProblemKind};

#[tokio::test]
async fn problems_match_the_gateway() {
    let pairs = [
        (ProblemKind::MissingKey, Kind::MissingKey),
        (ProblemKind::InvalidKey, Kind::InvalidKey),
        (ProblemKind::KeyNotAllowed, Kind::KeyNotAllowed),
        (ProblemKind::Unauthenticated, Kind::Unauthenticated),
        (ProblemKind::RequestInFlight, Kind::RequestInFlight),
        (ProblemKind::ResponseNotRetained, Kind::ResponseNotRetained),
        (ProblemKind::OutcomeUnknown, Kind::OutcomeUnknown),
        (ProblemKind::KeyReused, Kind::KeyReused),
        (ProblemKind::PayloadTooLarge, Kind::PayloadTooLarge),
        (ProblemKind::StoreUnavailable, Kind::StoreUnavailable),
        (ProblemKind::BadRequest, Kind::BadRequest),
        (ProblemKind::UpstreamUnavailable, Kind::UpstreamUnavailable),
        (ProblemKind::NotFound, Kind::NotFound),
    ];
    for (ours, theirs) in pairs {
        assert_eq!(ours.slug(), theirs.slug());
        assert_eq!(ours.status(), theirs.status());
        assert_eq!(ours.title(), theirs.title(), "{}", ours.slug());
        let mine = Problem::new(ours, "detail")
            .operation("op_1")
            .retry_after(2)
            .into_response::<String>();
        let gw = GatewayProblem::new(theirs, "detail")
            .operation("op_1")
            .retry_after(2)
            .into_response();
        assert_eq!(mine.status(), gw.status());
        for h in ["content-type", "retry-after", "x-operation-id"] {
            assert_eq!(mine.headers().get(h), gw.headers().get(h), "{h}");
        }
        let a = mine.into_body().collect().await.unwrap().to_bytes();
        let b = gw.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(a, b, "{}", ours.slug());
    }
}
