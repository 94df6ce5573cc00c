// End-to-end test of examples/checkout.rs in headless Chromium, driven by
// playwright-core. Run it through tests/e2e/run.sh, which installs Chromium
// and playwright-core, builds the example, starts the servers and passes
// their addresses here:
//
//   E2E_MEMORY_URL        one checkout server on the in-memory backend
//   E2E_REDIS_URL_A/_B    two checkout servers sharing one redis-server
//   E2E_OUT               screenshot folder (default target/e2e-screenshots)
//   E2E_DELAY_MS          how long /pay runs (default 800), so clicks overlap
//   CHROMIUM              browser binary (default /usr/bin/chromium)
//
// The page's Pay button is never disabled: every click sends a POST, and the
// layer on the server is what keeps a double click from paying twice.

import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "../..");

function need(name) {
  const v = process.env[name];
  if (!v) {
    throw new Error(`${name} is not set: run this test through tests/e2e/run.sh`);
  }
  return v.replace(/\/$/, "");
}

const MEMORY = need("E2E_MEMORY_URL");
const REDIS_A = need("E2E_REDIS_URL_A");
const REDIS_B = need("E2E_REDIS_URL_B");
const OUT = path.resolve(root, process.env.E2E_OUT || "target/e2e-screenshots");
const DELAY_MS = Number(process.env.E2E_DELAY_MS || 800);
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";
// Longest wait for the page to show every click's outcome.
const SETTLE_MS = DELAY_MS + 15_000;

let browser;
const contexts = [];

before(async () => {
  mkdirSync(OUT, { recursive: true });
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    // playwright-core starts the browser with a fresh temporary profile.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      "--disable-quic",
      "--no-first-run",
    ],
  });
});

after(async () => {
  for (const c of contexts) await c.close().catch(() => {});
  if (browser) await browser.close();
});

/** A new browser context: a separate cookie jar, i.e. another user. */
async function newUser() {
  const context = await browser.newContext({ viewport: { width: 760, height: 560 } });
  contexts.push(context);
  return context;
}

/** Open the checkout page of `server` in `context`. */
async function openCheckout(context, server) {
  const page = await context.newPage();
  const res = await page.goto(`${server}/?delay_ms=${DELAY_MS}`);
  assert.equal(res.status(), 200, `GET ${server}/`);
  await page.locator("#pay").waitFor();
  return page;
}

async function executions(server) {
  const res = await fetch(`${server}/stats`);
  assert.equal(res.status, 200, `GET ${server}/stats`);
  const body = await res.json();
  assert.equal(typeof body.executions, "number", JSON.stringify(body));
  return body.executions;
}

/** Wait until the page lists `count` clicks, none of them still pending. */
async function settle(page, count) {
  await page.waitForFunction(
    (n) => {
      const items = document.querySelectorAll("#outcomes li");
      return items.length === n && ![...items].some((li) => li.dataset.outcome === "pending");
    },
    count,
    { timeout: SETTLE_MS },
  );
}

/** The outcomes listed on the page, in click order. */
async function outcomes(page) {
  return page.$$eval("#outcomes li", (items) =>
    items.map((li) => ({
      click: Number(li.dataset.click),
      outcome: li.dataset.outcome,
      status: Number(li.dataset.status),
      start: Number(li.dataset.start),
      end: Number(li.dataset.end),
      text: li.textContent,
    })),
  );
}

function count(list, outcome) {
  return list.filter((o) => o.outcome === outcome).length;
}

/** Check every listed outcome is a 200 success or a 409 "already in progress". */
function assertOnlySuccessOrInProgress(list) {
  for (const o of list) {
    if (o.outcome === "success") {
      assert.equal(o.status, 200, o.text);
      assert.match(o.text, /paid/i);
    } else {
      assert.equal(o.outcome, "in-progress", `unexpected outcome: ${o.text}`);
      assert.equal(o.status, 409, o.text);
      assert.match(o.text, /already in progress/i);
    }
  }
}

/** The two payments ran at the same time: each started before the other ended. */
function assertOverlap(a, b) {
  assert.ok(
    Math.max(a.start, b.start) < Math.min(a.end, b.end),
    `the two payments did not overlap: ${JSON.stringify([a, b])}`,
  );
}

async function shot(page, name) {
  await page.screenshot({ path: path.join(OUT, name), fullPage: true });
}

/**
 * One screenshot of several pages side by side, each under a label, with a
 * caption below (the figures the test checked).
 */
async function sideBySide(name, panes, caption) {
  const escape = (t) => t.replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`);
  const cells = [];
  for (const [label, page] of panes) {
    const png = (await page.screenshot({ fullPage: true })).toString("base64");
    cells.push(
      `<figure><figcaption>${escape(label)}</figcaption>` +
        `<img src="data:image/png;base64,${png}"></figure>`,
    );
  }
  const sheet = await browser.newPage({ viewport: { width: 760 * panes.length + 40, height: 400 } });
  try {
    await sheet.setContent(
      `<!doctype html><style>
        body { margin:0; padding:12px 20px; background:#fff; font:14px system-ui, sans-serif; color:#1f2430; }
        .row { display:flex; gap:0; }
        figure { margin:0; border-left:1px dashed #d1d5db; }
        figure:first-child { border-left:0; }
        figcaption { font-weight:600; padding:4px 12px; }
        img { display:block; width:760px; }
        p { margin:10px 12px 0; font-weight:600; }
      </style><div class="row">${cells.join("")}</div><p>${escape(caption)}</p>`,
    );
    await sheet.screenshot({ path: path.join(OUT, name), fullPage: true });
  } finally {
    await sheet.close();
  }
}

async function userOf(page) {
  return (await page.locator("#user").textContent()).trim();
}

/** The page says which backend its server locks with. */
async function assertBackend(page, re) {
  assert.match((await page.locator("#backend").textContent()).trim(), re);
}

test("memory: a double click on Pay runs the payment once", async () => {
  const page = await openCheckout(await newUser(), MEMORY);
  const base = await executions(MEMORY);

  await page.dblclick("#pay");
  // The button is not disabled while the payment runs: the server protects.
  assert.equal(await page.isEnabled("#pay"), true);
  await settle(page, 2);

  const list = await outcomes(page);
  assertOnlySuccessOrInProgress(list);
  assert.equal(count(list, "success"), 1, JSON.stringify(list));
  assert.equal(count(list, "in-progress"), 1, JSON.stringify(list));
  assert.equal((await executions(MEMORY)) - base, 1, "executions of /pay");
  await shot(page, "01-memory-double-click.png");
});

test("memory: a triple click runs once, and a click after completion pays again", async () => {
  const page = await openCheckout(await newUser(), MEMORY);
  const base = await executions(MEMORY);

  await page.click("#pay", { clickCount: 3 });
  await settle(page, 3);
  let list = await outcomes(page);
  assertOnlySuccessOrInProgress(list);
  assert.equal(count(list, "success"), 1, JSON.stringify(list));
  assert.equal(count(list, "in-progress"), 2, JSON.stringify(list));
  assert.equal((await executions(MEMORY)) - base, 1, "executions after the triple click");

  // Every outcome is on the page, so the first payment's response was read
  // to the end: the lease is gone and the same payment is admitted again.
  await page.click("#pay");
  await settle(page, 4);
  list = await outcomes(page);
  assert.equal(list[3].outcome, "success", JSON.stringify(list[3]));
  assert.equal((await executions(MEMORY)) - base, 2, "executions after the fourth click");
  await shot(page, "02-memory-triple-click-then-again.png");
});

test("memory: two users paying at the same moment both succeed", async () => {
  const alice = await openCheckout(await newUser(), MEMORY);
  const bob = await openCheckout(await newUser(), MEMORY);
  await assertBackend(alice, /^memory$/);
  assert.notEqual(await userOf(alice), await userOf(bob), "two contexts got two cookies");
  const base = await executions(MEMORY);

  await Promise.all([alice.click("#pay"), bob.click("#pay")]);
  await Promise.all([settle(alice, 1), settle(bob, 1)]);

  const [a] = await outcomes(alice);
  const [b] = await outcomes(bob);
  assert.equal(a.outcome, "success", a.text);
  assert.equal(b.outcome, "success", b.text);
  assertOverlap(a, b);
  assert.equal((await executions(MEMORY)) - base, 2, "executions of /pay");
  await sideBySide(
    "03-memory-two-users.png",
    [["user A (own context)", alice], ["user B (own context)", bob]],
    `Same server, memory backend: two users, two payments at once, /stats +${(await executions(MEMORY)) - base}`,
  );
});

test("redis, two servers: two users, one on each server, both succeed", async () => {
  const alice = await openCheckout(await newUser(), REDIS_A);
  const bob = await openCheckout(await newUser(), REDIS_B);
  await assertBackend(alice, /^redis/);
  await assertBackend(bob, /^redis/);
  assert.notEqual(await userOf(alice), await userOf(bob), "two contexts got two cookies");
  const baseA = await executions(REDIS_A);
  const baseB = await executions(REDIS_B);

  await Promise.all([alice.click("#pay"), bob.click("#pay")]);
  await Promise.all([settle(alice, 1), settle(bob, 1)]);

  const [a] = await outcomes(alice);
  const [b] = await outcomes(bob);
  assert.equal(a.outcome, "success", a.text);
  assert.equal(b.outcome, "success", b.text);
  assertOverlap(a, b);
  assert.equal((await executions(REDIS_A)) - baseA, 1, "executions on server A");
  assert.equal((await executions(REDIS_B)) - baseB, 1, "executions on server B");
  await sideBySide(
    "04-redis-two-users.png",
    [["user A on server A", alice], ["user B on server B", bob]],
    "Two servers sharing Redis: two users paying at once both succeed, /stats +1 on each server",
  );
});

test("redis, two servers: one user double-clicking on both at once pays once in total", async () => {
  // The same user in two browsers (two contexts), each behind another server.
  const first = await newUser();
  const pageA = await openCheckout(first, REDIS_A);
  const second = await newUser();
  await second.addCookies(await first.cookies());
  const pageB = await openCheckout(second, REDIS_B);
  await assertBackend(pageA, /^redis/);
  await assertBackend(pageB, /^redis/);
  const user = await userOf(pageA);
  assert.equal(await userOf(pageB), user, "server B sees the same user cookie");
  assert.notEqual(await pageA.locator("#server").textContent(), await pageB.locator("#server").textContent());

  const total = async () => (await executions(REDIS_A)) + (await executions(REDIS_B));
  const base = await total();

  await Promise.all([pageA.dblclick("#pay"), pageB.dblclick("#pay")]);
  await Promise.all([settle(pageA, 2), settle(pageB, 2)]);

  const list = [...(await outcomes(pageA)), ...(await outcomes(pageB))];
  assertOnlySuccessOrInProgress(list);
  assert.equal(count(list, "success"), 1, JSON.stringify(list));
  assert.equal(count(list, "in-progress"), 3, JSON.stringify(list));
  assert.equal((await total()) - base, 1, "executions on both servers together");
  await sideBySide(
    "05-redis-same-user-two-servers.png",
    [[`user ${user} on server A`, pageA], [`same user ${user} on server B`, pageB]],
    "Two servers sharing Redis: the same user double-clicks on both pages at once: " +
      "4 clicks, 1 payment in total (/stats summed over both servers +1)",
  );

  // Released in Redis once done: the same payment goes through on server B.
  await pageB.click("#pay");
  await settle(pageB, 3);
  const [, , third] = await outcomes(pageB);
  assert.equal(third.outcome, "success", third.text);
  assert.equal((await total()) - base, 2, "executions after one more click");
  await sideBySide(
    "06-redis-same-user-then-again.png",
    [["server A", pageA], ["server B: one more click after completion", pageB]],
    "After the first payment completed, the lease is gone from Redis: the next click pays (+1)",
  );
});

test("a payment without the session cookie is refused with 401 problem+json", async () => {
  const base = await executions(MEMORY);
  const res = await fetch(`${MEMORY}/pay`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ item: "merino-scarf", amount_cents: 4200 }),
  });
  assert.equal(res.status, 401);
  assert.equal(res.headers.get("content-type"), "application/problem+json");
  const problem = await res.json();
  assert.equal(problem.status, 401);
  assert.match(problem.detail, /cookie/);
  assert.equal((await executions(MEMORY)) - base, 0, "the handler did not run");
});

/** The "Pay once" outcomes: every click paid (201), with its payment id. */
function assertAllPaidOnce(list) {
  for (const o of list) {
    assert.equal(o.outcome, "success", o.text);
    assert.equal(o.status, 201, o.text);
    assert.match(o.text, /paid/i);
  }
}

async function payments(page) {
  return page.$$eval("#outcomes li", (items) =>
    items.map((li) => ({ payment: li.dataset.payment, replayed: li.dataset.replayed === "true" })),
  );
}

test("memory: Pay once, double-clicked, shows paid twice with the same payment id, one execution", async () => {
  const page = await openCheckout(await newUser(), MEMORY);
  const base = await executions(MEMORY);

  await page.dblclick("#pay-once");
  assert.equal(await page.isEnabled("#pay-once"), true);
  await settle(page, 2);
  let list = await outcomes(page);
  assertAllPaidOnce(list);
  let ids = await payments(page);
  assert.match(ids[0].payment, /^pay_[0-9a-f]{16}$/, JSON.stringify(ids));
  assert.equal(ids[1].payment, ids[0].payment, "the same payment twice");
  assert.equal(ids.filter((p) => p.replayed).length, 1, "the second click joined the first");
  assertOverlap(list[0], list[1]);
  assert.equal((await executions(MEMORY)) - base, 1, "executions of /pay-once");

  // The same checkout attempt once more, after completion: still that payment.
  await page.click("#pay-once");
  await settle(page, 3);
  ids = await payments(page);
  assert.equal(ids[2].payment, ids[0].payment);
  assert.equal(ids[2].replayed, true);
  assert.equal((await executions(MEMORY)) - base, 1, "still one execution");
  await shot(page, "07-memory-pay-once-double-click.png");
});

test("redis, two servers: one checkout attempt double-clicked on both pages pays once, same payment everywhere", async () => {
  // The same user and the same checkout attempt in two browsers, each behind another server.
  const first = await newUser();
  const attempt = "e2e" + Date.now().toString(16);
  const open = async (context, server) => {
    const page = await context.newPage();
    const res = await page.goto(`${server}/?delay_ms=${DELAY_MS}&attempt=${attempt}`);
    assert.equal(res.status(), 200);
    await page.locator("#pay-once").waitFor();
    return page;
  };
  const pageA = await open(first, REDIS_A);
  const second = await newUser();
  await second.addCookies(await first.cookies());
  const pageB = await open(second, REDIS_B);
  assert.equal(await userOf(pageB), await userOf(pageA), "server B sees the same user cookie");

  const total = async () => (await executions(REDIS_A)) + (await executions(REDIS_B));
  const base = await total();
  await Promise.all([pageA.dblclick("#pay-once"), pageB.dblclick("#pay-once")]);
  await Promise.all([settle(pageA, 2), settle(pageB, 2)]);

  const list = [...(await outcomes(pageA)), ...(await outcomes(pageB))];
  assertAllPaidOnce(list);
  const ids = [...(await payments(pageA)), ...(await payments(pageB))];
  assert.equal(new Set(ids.map((p) => p.payment)).size, 1, JSON.stringify(ids));
  assert.equal(ids.filter((p) => !p.replayed).length, 1, "one click ran it, three got its answer");
  assert.equal((await total()) - base, 1, "executions on both servers together");
  await sideBySide(
    "08-redis-pay-once-two-servers.png",
    [[`attempt ${attempt} on server A`, pageA], [`same attempt on server B`, pageB]],
    `Two servers sharing Redis, Pay once: 4 clicks, all paid with payment ${ids[0].payment}, ` +
      "1 execution in total (/stats summed over both servers +1)",
  );
});
