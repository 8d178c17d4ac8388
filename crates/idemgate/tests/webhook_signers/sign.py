#!/usr/bin/env python3
"""Signs a webhook delivery with a provider's own Python SDK, for tests/webhooks.rs.

Reads one JSON request on stdin and prints the value the provider would send:
  {"sdk": "stripe", "secret", "timestamp", "body"}            -> Stripe-Signature
  {"sdk": "standardwebhooks", "secret", "msg_id", "timestamp", "body"} -> webhook-signature
  {"sdk": "twilio", "secret", "url", "params": [[name, value], ...]}   -> X-Twilio-Signature
  {"sdk": "twilio_hash", "body"}                              -> the bodySHA256 value
Run with the interpreter of the venv that .ci/run installs the SDKs into.
"""

import datetime
import json
import sys


def stripe_header(req):
    from stripe import WebhookSignature

    generate = getattr(WebhookSignature, "generate_signature_header", None)
    if generate is not None:
        return generate(req["body"], req["secret"], timestamp=req["timestamp"])
    # Older SDKs only have the private helper the public one wraps.
    t = req["timestamp"]
    return "t=%d,v1=%s" % (t, WebhookSignature._compute_signature("%d.%s" % (t, req["body"]), req["secret"]))


def standard_signature(req):
    from standardwebhooks import Webhook

    ts = datetime.datetime.fromtimestamp(req["timestamp"], tz=datetime.timezone.utc)
    return Webhook(req["secret"]).sign(req["msg_id"], ts, req["body"])


def twilio_signature(req):
    from multidict import MultiDict
    from twilio.request_validator import RequestValidator

    validator = RequestValidator(req["secret"])
    params = MultiDict([tuple(p) for p in req.get("params", [])])
    signature = validator.compute_signature(req["url"], params)
    # The SDK's own validator must accept what it signed, or the test would prove nothing.
    body = req.get("body")
    assert validator.validate(req["url"], body if body is not None else params, signature)
    return signature


def twilio_hash(req):
    from twilio.request_validator import RequestValidator

    return RequestValidator("unused").compute_hash(req["body"])


def main():
    req = json.load(sys.stdin)
    out = {
        "stripe": stripe_header,
        "standardwebhooks": standard_signature,
        "twilio": twilio_signature,
        "twilio_hash": twilio_hash,
    }[req["sdk"]](req)
    sys.stdout.write(out)


if __name__ == "__main__":
    main()
