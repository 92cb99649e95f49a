//! The demo workers' Prometheus endpoint: the process's [`metrics`] series (the connector's
//! `vllm:nixl_*`, see [`nixl_connector::series`]) rendered by `metrics-exporter-prometheus`
//! and served as text on `GET /metrics`.
//!
//! The connector only records through the `metrics` facade; picking an exporter is the
//! engine's business, and this is how the demo does it. Start it before any connector
//! worker exists: workers take their metric handles from the recorder installed when they
//! are created.
//!
//! Each connection gets one answer and is closed; a request head longer than
//! [`MAX_REQUEST_HEAD`] or slower than [`REQUEST_DEADLINE`] is dropped.

use std::net::SocketAddr;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::error::{Error, Result};

/// Longest request head read from a scraper.
pub const MAX_REQUEST_HEAD: usize = 8 << 10;

/// Total time a scraper has to send its request head.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);

/// How often histogram samples are folded into the rendered buckets.
const UPKEEP: Duration = Duration::from_secs(5);

/// Installs the Prometheus recorder as the process's global recorder (with vLLM's buckets
/// for the connector's histograms), and serves it on `addr` (port 0: any free port) from
/// tasks on the current tokio runtime; returns the bound address.
///
/// # Errors
/// [`Error::Config`] when a recorder is already installed; [`Error::Io`] when `addr`
/// cannot be bound.
pub async fn serve(addr: SocketAddr) -> Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|err| Error::io(format!("listen for metrics scrapes on {addr}"), err))?;
    let bound = listener
        .local_addr()
        .map_err(|err| Error::io("query the metrics address", err))?;
    let mut builder = PrometheusBuilder::new();
    for name in nixl_connector::series::HISTOGRAMS {
        if let Some(buckets) = nixl_connector::series::buckets(name) {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)
                .map_err(|err| Error::Config(format!("metrics buckets of {name}: {err}")))?;
        }
    }
    let handle = builder
        .install_recorder()
        .map_err(|err| Error::Config(format!("cannot install the Prometheus recorder: {err}")))?;
    nixl_connector::series::describe();
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(accept(listener, handle));
    Ok(bound)
}

async fn accept(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let handle = handle.clone();
                tokio::spawn(async move {
                    if let Err(err) = answer(stream, &handle).await {
                        tracing::debug!(%peer, %err, "metrics scrape not answered");
                    }
                });
            }
            Err(err) => {
                tracing::warn!(%err, "accepting a metrics scrape failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Reads one request head and answers it: the metrics for `GET /metrics`, 404 otherwise.
async fn answer(mut stream: TcpStream, handle: &PrometheusHandle) -> std::io::Result<()> {
    let head = tokio::time::timeout(REQUEST_DEADLINE, read_head(&mut stream))
        .await
        .map_err(|_| std::io::Error::other("no request head in time"))??;
    let (status, body) = if head.starts_with(b"GET /metrics ") || head.starts_with(b"GET /metrics?")
    {
        handle.run_upkeep();
        ("200 OK", handle.render())
    } else {
        ("404 Not Found", "only GET /metrics is served\n".to_string())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// Reads up to the blank line ending a request head, at most [`MAX_REQUEST_HEAD`] bytes.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() >= MAX_REQUEST_HEAD {
            return Err(std::io::Error::other("request head too long"));
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::Error::other(
                "closed before the end of the request head",
            ));
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(head)
}
