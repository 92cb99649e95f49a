//! `kv_transfer_params` as the JSON of a scenario's protocol: what a router hands from one
//! engine to the other.

use nixl_connector::KvTransferParams;

use super::scenario::Scenario;

/// `params` as JSON: vLLM's in vLLM's protocol, else the connector's.
pub(super) fn to_json(scenario: &Scenario, params: &KvTransferParams) -> String {
    if scenario.vllm {
        params.to_vllm_json()
    } else {
        serde_json::to_string(params).expect("params as JSON")
    }
}

/// The params of `json` ([`to_json`]'s).
///
/// # Errors
/// Why the JSON was refused.
pub(super) fn from_json(scenario: &Scenario, json: &str) -> Result<KvTransferParams, String> {
    if scenario.vllm {
        KvTransferParams::from_vllm_json(json).map_err(|err| err.to_string())
    } else {
        serde_json::from_str(json).map_err(|err| err.to_string())
    }
}
