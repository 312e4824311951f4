// blast-vs-otp: tenant A blasts marketing email through the ingest API as fast as it can while
// tenant B publishes OTPs at a constant arrival rate. Each OTP is followed until the provider has
// it (GET /v1/sends/{id}: accepted_at_ms -> completed_at_ms); the thresholds fail the run when the
// OTP latency budget is missed or any OTP is not delivered in time (dropped).
//
// Run against the local stack with `bash k6/run.sh` (add `--baseline` for the naive single lane).
import http from 'k6/http';
import { check, sleep } from 'k6';
import { Counter, Trend } from 'k6/metrics';

const API = __ENV.API_URL || 'http://127.0.0.1:18000';
const BLAST_KEY = __ENV.BLAST_KEY;
const OTP_KEY = __ENV.OTP_KEY;
const OTP_RATE = parseInt(__ENV.OTP_RATE || '4', 10);
const DURATION = __ENV.DURATION || '30s';
const BUDGET_MS = parseInt(__ENV.OTP_BUDGET_MS || '1000', 10);
const DELIVERY_TIMEOUT_S = parseFloat(__ENV.DELIVERY_TIMEOUT_S || '15');
const BLAST_BATCH = parseInt(__ENV.BLAST_BATCH || '500', 10);

const otpLatency = new Trend('otp_e2e_ms', true);
const otpDropped = new Counter('otp_dropped');
const otpDelivered = new Counter('otp_delivered');
const blastAccepted = new Counter('blast_accepted');

export const options = {
  scenarios: {
    blast: { executor: 'constant-vus', vus: parseInt(__ENV.BLAST_VUS || '1', 10), duration: DURATION, exec: 'blast' },
    otp: {
      executor: 'constant-arrival-rate', rate: OTP_RATE, timeUnit: '1s', duration: DURATION,
      preAllocatedVUs: 20, maxVUs: 200, exec: 'otp',
    },
  },
  thresholds: {
    otp_e2e_ms: [`p(99)<${BUDGET_MS}`],
    otp_dropped: ['count==0'],
    otp_delivered: ['count>0'],
    'http_req_failed{scenario:otp}': ['rate==0'],
  },
};

function email(category) {
  return {
    channel: 'email', category, template_id: 'k6', template_version: '1',
    payload: {
      from: 'Load <load@acme.test>', to: ['someone@example.test'],
      subject: category === 'marketing' ? 'Our sale' : 'Your code', html: '<p>hello</p>',
    },
  };
}

function headers(key) {
  return { headers: { Authorization: `Bearer ${key}`, 'Content-Type': 'application/json' } };
}

export function blast() {
  const sends = [];
  for (let i = 0; i < BLAST_BATCH; i++) sends.push(email('marketing'));
  const res = http.post(`${API}/v1/sends/batch`, JSON.stringify({ sends }), headers(BLAST_KEY));
  if (check(res, { 'blast accepted': (r) => r.status === 202 })) blastAccepted.add(BLAST_BATCH);
}

export function otp() {
  const res = http.post(`${API}/v1/sends`, JSON.stringify(email('transactional')), headers(OTP_KEY));
  if (!check(res, { 'otp accepted': (r) => r.status === 202 })) { otpDropped.add(1); return; }
  const id = res.json('send_id');
  const deadline = Date.now() + DELIVERY_TIMEOUT_S * 1000;
  while (Date.now() < deadline) {
    const s = http.get(`${API}/v1/sends/${id}`, Object.assign(headers(OTP_KEY), { tags: { name: 'status' } }));
    if (s.status === 200 && s.json('status') === 'delivered') {
      otpLatency.add(s.json('completed_at_ms') - s.json('accepted_at_ms'));
      otpDelivered.add(1);
      return;
    }
    sleep(0.05);
  }
  otpDropped.add(1); // not delivered within the timeout: as good as dropped for the person waiting
}
