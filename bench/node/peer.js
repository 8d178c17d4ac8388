// A peer for bench/run.sh: an express app whose one handler answers like the static upstream
// ({"ok":true,"id":"ord_1"}, application/json), behind a Node idempotency middleware on Redis.
//
//   node peer.js express-idempotency|node-idempotency PORT REDIS_URL KEY_PREFIX
//
// Both middlewares are used as their READMEs show. Each replay is marked with
// `Idempotent-Replayed: true` (what idemgate sends), so bench/idem.lua can check that a replay
// row really replays; the marker costs one setHeader call.
//
// - express-idempotency 1.0.6 + express-idempotency-redis-adapter 1.0.8: the middleware looks the
//   key up, creates the resource, lets the handler run, and stores the response after it is sent
//   (fire and forget). It uses the raw header value as the Redis key, so the harness sends keys
//   that start with KEY_PREFIX and deletes them afterwards.
// - @node-idempotency/core 1.0.11 + @node-idempotency/storage-adapter-redis 1.0.2: there is no
//   published @node-idempotency/express (npm answers 404), so the express glue below is the
//   pattern of its nestjs wrapper: onRequest (SET NX, or GET on a hit) before the handler,
//   onResponse (SET) before the response is sent. cacheKeyPrefix = KEY_PREFIX.
'use strict';

const express = require('express');

const [kind, portArg, redisUrl, keyPrefix] = process.argv.slice(2);
const port = Number(portArg);
if (!kind || !port || !redisUrl || !keyPrefix) {
  console.error('usage: node peer.js express-idempotency|node-idempotency PORT REDIS_URL KEY_PREFIX');
  process.exit(64);
}

const BODY = { ok: true, id: 'ord_1' };
const app = express();
app.disable('x-powered-by');
app.disable('etag');
app.use(express.json());

async function main() {
  if (kind === 'express-idempotency') {
    const { idempotency, getSharedIdempotencyService } = require('express-idempotency');
    const RedisAdapter = require('express-idempotency-redis-adapter').default;
    const adapter = new RedisAdapter({ connectionConfig: { url: redisUrl } });
    await adapter.connect();
    // replay marker: the middleware flags a hit on the request before it sends the stored response
    app.use((req, res, next) => {
      const send = res.send;
      res.send = function (body) {
        if (req.headers['x-hit'] === 'true') this.setHeader('Idempotent-Replayed', 'true');
        return send.call(this, body);
      };
      next();
    });
    app.post('*', idempotency({ dataAdapter: adapter }));
    app.post('*', (req, res) => {
      if (getSharedIdempotencyService().isHit(req)) return;
      res.status(200).json(BODY);
    });
  } else if (kind === 'node-idempotency') {
    const { Idempotency, IdempotencyError } = require('@node-idempotency/core');
    const { RedisStorageAdapter } = require('@node-idempotency/storage-adapter-redis');
    const storage = new RedisStorageAdapter({ url: redisUrl });
    await storage.connect();
    const idem = new Idempotency(storage, { cacheKeyPrefix: keyPrefix });
    app.post('*', async (req, res) => {
      const ireq = { method: req.method, headers: req.headers, body: req.body, path: req.path };
      try {
        const hit = await idem.onRequest(ireq);
        if (hit) {
          res.set(hit.additional?.headers ?? {});
          res.set('Idempotent-Replayed', 'true');
          return res.status(hit.additional?.status ?? 200).json(hit.body);
        }
      } catch (err) {
        if (err instanceof IdempotencyError) return res.status(409).json({ error: err.message });
        return res.status(500).json({ error: String(err) });
      }
      // the handler: answers like the static upstream
      const out = { body: BODY, additional: { status: 200 } };
      try {
        await idem.onResponse(ireq, out);
      } catch (err) {
        return res.status(500).json({ error: String(err) });
      }
      res.status(200).json(BODY);
    });
  } else {
    throw new Error(`unknown peer ${kind}`);
  }
  app.listen(port, '127.0.0.1', () => console.error(`${kind} on 127.0.0.1:${port}`));
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
