//! Every load runs in a `nixl_load` tracing span that ends with its outcome: `loaded`,
//! `failed`, or `notified` for a load that only notifies (a full prefix hit).

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{fill, remote, spec, worker};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The `request` and `outcome` fields of a span.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Fields {
    request: String,
    outcome: String,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "request" => self.request = value.to_string(),
            "outcome" => self.outcome = value.to_string(),
            _ => {}
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

/// Collects the fields of every closed `nixl_load` span.
#[derive(Clone, Default)]
struct LoadSpans(Arc<Mutex<Vec<Fields>>>);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for LoadSpans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id).filter(|s| s.name() == "nixl_load") {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(fields) = ctx
            .span(&id)
            .and_then(|s| s.extensions().get::<Fields>().cloned())
        {
            self.0.lock().unwrap().push(fields);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_load_has_a_span_with_its_outcome() {
    let spans = LoadSpans::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(spans.clone()))
        .expect("the only subscriber of this test binary");
    let spec = spec(2);
    let prefill = worker("pf-spans", 0, 1, &spec);
    fill(&prefill, &spec);
    let decode = worker("dc-spans", 0, 1, &spec);
    decode
        .start_load(
            "good",
            &[0, 1],
            &remote(&prefill, "pf-spans", "p-good", vec![2, 3], 1),
        )
        .unwrap();
    decode
        .start_load(
            "hit",
            &[],
            &remote(&prefill, "pf-spans", "p-hit", vec![4], 1),
        )
        .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut gone = remote(&prefill, "pf-gone", "p-gone", vec![5], 1);
    gone.port = closed.local_addr().unwrap().port();
    drop(closed);
    decode.start_load("gone", &[6], &gone).unwrap();

    let start = Instant::now();
    while spans.0.lock().unwrap().len() < 3 && start.elapsed() < Duration::from_secs(10) {
        decode.finished();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut got = spans.0.lock().unwrap().clone();
    got.sort_by(|a, b| a.request.cmp(&b.request));
    let pairs: Vec<(&str, &str)> = got
        .iter()
        .map(|f| (f.request.as_str(), f.outcome.as_str()))
        .collect();
    assert_eq!(
        pairs,
        [("gone", "failed"), ("good", "loaded"), ("hit", "notified")]
    );
}
