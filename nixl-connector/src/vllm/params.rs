//! vLLM's JSON `kv_transfer_params`, as its `request_finished` returns them and proxies hand
//! them between engines, and their conversion to and from the connector's own
//! [`KvTransferParams`].
//!
//! The conversion to and from JSON is lossless: absent keys stay absent, a `null` stays
//! `null`, and keys this type does not know are kept as they came (each unknown key name is
//! logged once per process). The known keys are declared once, as the fields of
//! [`VllmKvTransferParams`], which give both directions of the conversion.

use std::collections::BTreeSet;
use std::sync::Mutex;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::transport::params::KvTransferParams;

/// `remote_block_ids`: one list of block ids (older vLLM, and this connector's own), or one
/// list per KV cache group (vLLM 0.33).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VllmBlockIds {
    /// `[1, 2, 3]` (also what `[]` reads as).
    Flat(Vec<u64>),
    /// `[[1, 2], [7]]`: per KV cache group.
    Groups(Vec<Vec<u64>>),
}

impl Serialize for VllmBlockIds {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            VllmBlockIds::Flat(ids) => ids.serialize(serializer),
            VllmBlockIds::Groups(groups) => groups.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for VllmBlockIds {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let items = Vec::<Value>::deserialize(deserializer)?;
        if items.iter().all(Value::is_array) && !items.is_empty() {
            let groups = Value::Array(items);
            return Vec::<Vec<u64>>::deserialize(groups)
                .map(VllmBlockIds::Groups)
                .map_err(|err| D::Error::custom(format!("a KV cache group's block ids: {err}")));
        }
        Vec::<u64>::deserialize(Value::Array(items))
            .map(VllmBlockIds::Flat)
            .map_err(|err| {
                D::Error::custom(format!(
                    "expected block ids, or one list of them per KV cache group: {err}"
                ))
            })
    }
}

/// Declares [`VllmKvTransferParams`] from one list of vLLM's known keys, each a field named
/// as its key, of type `Option<_>`, and `other` after them. The same list gives [`KNOWN_KEYS`], the
/// deserialization's reads (`take_known`) and the serialization's writes (`put_known`), so
/// the three cannot disagree: a key is added in one place.
macro_rules! vllm_kv_transfer_params {
    (
        $(#[$struct_attr:meta])*
        pub struct VllmKvTransferParams {
            $( $(#[$field_attr:meta])* pub $key:ident: $ty:ty, )+
        }
    ) => {
        $(#[$struct_attr])*
        pub struct VllmKvTransferParams {
            $( $(#[$field_attr])* pub $key: $ty, )+
            /// Unknown keys, and known keys whose value is `null`, as they came.
            pub other: Map<String, Value>,
        }

        /// The keys of vLLM's `kv_transfer_params` that [`VllmKvTransferParams`] has a field
        /// for, in the order of its fields.
        pub(crate) const KNOWN_KEYS: &[&str] = &[$(stringify!($key)),+];

        impl VllmKvTransferParams {
            /// Takes every known key out of `map` (see [`take`]); `other` is left empty.
            fn take_known<E: serde::de::Error>(
                map: &mut Map<String, Value>,
            ) -> std::result::Result<Self, E> {
                Ok(VllmKvTransferParams {
                    $( $key: take(map, stringify!($key))?, )+
                    other: Map::new(),
                })
            }

            /// Puts every known key that has a value into `map` (see [`put`]).
            fn put_known(&self, map: &mut Map<String, Value>) {
                $( put(map, stringify!($key), &self.$key); )+
            }
        }
    };
}

vllm_kv_transfer_params! {
    /// vLLM's `kv_transfer_params`. Every field is optional, as in vLLM's dict; [`other`]
    /// holds unknown keys and `null` values, so nothing is lost on the way back to JSON.
    ///
    /// [`other`]: VllmKvTransferParams::other
    #[derive(Debug, Clone, Default, PartialEq)]
    pub struct VllmKvTransferParams {
        /// The KV is computed elsewhere and must be read (decode side).
        pub do_remote_prefill: Option<bool>,
        /// The KV will be read by a remote decode (prefill side).
        pub do_remote_decode: Option<bool>,
        /// The remote engine's blocks holding the request's KV.
        pub remote_block_ids: Option<VllmBlockIds>,
        /// The remote engine's id.
        pub remote_engine_id: Option<String>,
        /// The request's id on the remote engine (notifications name it).
        pub remote_request_id: Option<String>,
        /// The remote engine's side-channel host.
        pub remote_host: Option<String>,
        /// The remote engine's side-channel port (one per engine; ranks are asked by number).
        pub remote_port: Option<u16>,
        /// The remote engine's TP size.
        pub tp_size: Option<u32>,
        /// The remote engine's decode context parallel size.
        pub dcp_size: Option<u32>,
        /// The remote engine's pipeline parallel size.
        pub pp_size: Option<u32>,
        /// Tokens whose KV the remote engine holds.
        pub remote_num_tokens: Option<u64>,
        /// When the remote engine frees the blocks, on its clock (see
        /// [`MetaReply::clock_offset`](super::MetaReply::clock_offset)).
        pub remote_blocks_expiry_time: Option<f64>,
        /// The remote registration's generation (a newer one needs a new handshake).
        pub remote_registration_generation: Option<u64>,
        /// `"pull"` or `"push"`.
        pub transfer_mode: Option<String>,
    }
}

/// Takes `key` out of `map` as a `T`, leaving a `null` in place.
fn take<T: serde::de::DeserializeOwned, E: serde::de::Error>(
    map: &mut Map<String, Value>,
    key: &str,
) -> std::result::Result<Option<T>, E> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => {
            let value = map.remove(key).expect("present");
            serde_json::from_value(value)
                .map(Some)
                .map_err(|err| E::custom(format!("{key}: {err}")))
        }
    }
}

/// Puts `value` into `map` under `key`, unless it is `None`.
fn put<T: Serialize>(map: &mut Map<String, Value>, key: &str, value: &Option<T>) {
    if let Some(value) = value {
        let value = serde_json::to_value(value).expect("plain data encodes as JSON");
        map.insert(key.to_string(), value);
    }
}

/// The keys of `other` (what is left once the known keys are taken) that are not in
/// [`KNOWN_KEYS`]: the known keys whose value is `null` stay there too.
fn unknown_keys(other: &Map<String, Value>) -> impl Iterator<Item = &str> {
    other
        .keys()
        .map(String::as_str)
        .filter(|key| !KNOWN_KEYS.contains(key))
}

/// Most unknown key names remembered, so that each is logged once per process; names past
/// them are kept in the params as any other but not logged, so a peer inventing new names
/// costs no memory.
const MAX_UNKNOWN_KEYS_LOGGED: usize = 64;

/// The unknown key names logged so far in this process.
static UNKNOWN_KEYS_LOGGED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Logs `key`, an unknown key of vLLM's `kv_transfer_params`, at warning level the first
/// time this process sees it (up to [`MAX_UNKNOWN_KEYS_LOGGED`] names): it is kept and
/// passed on as it came, but nothing here reads it, so a newer vLLM's key shows in the log.
fn log_unknown_key_once(key: &str) {
    let mut logged = UNKNOWN_KEYS_LOGGED
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if logged.len() >= MAX_UNKNOWN_KEYS_LOGGED || logged.contains(key) {
        return;
    }
    logged.insert(key.to_string());
    tracing::warn!(
        key,
        "vLLM kv_transfer_params hold a key the connector does not know; it is kept as it came and not read (logged once per key)"
    );
}

impl<'de> Deserialize<'de> for VllmKvTransferParams {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let mut map = Map::deserialize(deserializer)?;
        let known = VllmKvTransferParams::take_known(&mut map)?;
        unknown_keys(&map).for_each(log_unknown_key_once);
        Ok(VllmKvTransferParams {
            other: map,
            ..known
        })
    }
}

impl Serialize for VllmKvTransferParams {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = self.other.clone();
        self.put_known(&mut map);
        map.serialize(serializer)
    }
}

impl VllmKvTransferParams {
    /// Parses vLLM's JSON.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the key whose value has the wrong type.
    pub fn from_json(json: &str) -> Result<Self> {
        serde_json::from_str(json)
            .map_err(|err| Error::invalid("parse vLLM kv_transfer_params", err.to_string()))
    }

    /// The JSON vLLM reads.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data encodes as JSON")
    }
}

impl TryFrom<&VllmKvTransferParams> for KvTransferParams {
    type Error = Error;

    /// The connector's params for vLLM's, refusing what they cannot say (a block id past
    /// `usize`) and what the connector cannot read (see
    /// [`KvTransferParams::check_supported`]). Block ids of several KV cache groups
    /// (vLLM 0.33's hybrid models) are flattened into
    /// [`KvTransferParams::remote_block_ids`], each group's count in
    /// [`KvTransferParams::remote_block_group_lens`]. Every other key is kept: unknown keys
    /// and `null` values in [`KvTransferParams::vllm_extra`].
    fn try_from(params: &VllmKvTransferParams) -> Result<Self> {
        const OPERATION: &str = "convert vLLM kv_transfer_params";
        let (ids, group_lens): (Vec<u64>, Vec<usize>) = match &params.remote_block_ids {
            None => (Vec::new(), Vec::new()),
            Some(VllmBlockIds::Flat(ids)) => (ids.clone(), Vec::new()),
            Some(VllmBlockIds::Groups(groups)) => match groups.as_slice() {
                [] => (Vec::new(), Vec::new()),
                [one] => (one.clone(), Vec::new()),
                more => (more.concat(), more.iter().map(Vec::len).collect()),
            },
        };
        let size = |key: &str, value: Option<u64>| {
            value
                .map(|v| {
                    usize::try_from(v).map_err(|_| {
                        Error::invalid(OPERATION, format!("{key} {v} does not fit in usize"))
                    })
                })
                .transpose()
        };
        let remote_block_ids = ids
            .iter()
            .map(|&id| usize::try_from(id))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|_| Error::invalid(OPERATION, "a remote block id does not fit in usize"))?;
        let native = KvTransferParams {
            do_remote_prefill: params.do_remote_prefill.unwrap_or(false),
            do_remote_decode: params.do_remote_decode.unwrap_or(false),
            remote_engine_id: params.remote_engine_id.clone(),
            remote_host: params.remote_host.clone(),
            remote_port: params.remote_port,
            remote_block_ids,
            remote_block_group_lens: group_lens,
            remote_request_id: params.remote_request_id.clone(),
            remote_tp_size: size("tp_size", params.tp_size.map(u64::from))?,
            // 0 is vLLM's "not known" (its decode reads `remote_num_tokens or 0`).
            remote_num_tokens: size("remote_num_tokens", params.remote_num_tokens)?
                .filter(|&n| n > 0),
            remote_dcp_size: size("dcp_size", params.dcp_size.map(u64::from))?,
            remote_pp_size: size("pp_size", params.pp_size.map(u64::from))?,
            remote_blocks_expiry_time: params.remote_blocks_expiry_time,
            remote_registration_generation: params.remote_registration_generation,
            transfer_mode: params.transfer_mode.clone(),
            // vLLM's protocol has no capabilities.
            remote_capability: None,
            remote_lease_epoch: None,
            vllm_extra: params.other.clone(),
        };
        native.check_supported()?;
        Ok(native)
    }
}

impl From<&KvTransferParams> for VllmKvTransferParams {
    /// vLLM's params for the connector's: every field, with the block ids as one list per
    /// KV cache group (as vLLM 0.33 reads them: one group, or the groups of
    /// [`KvTransferParams::remote_block_group_lens`] when their counts add up to the ids)
    /// when the params name a remote engine or hold blocks, and the keys of
    /// [`KvTransferParams::vllm_extra`] as they came. JSON that became `params` converts
    /// back to the same JSON, except that an absent `do_remote_prefill` or
    /// `do_remote_decode` comes back `false` and a flat list of block ids (older vLLM) as
    /// one group.
    fn from(params: &KvTransferParams) -> Self {
        let ids: Vec<u64> = params
            .remote_block_ids
            .iter()
            .map(|&id| id as u64)
            .collect();
        let groups = match crate::geometry::groups::split(
            &params.remote_block_ids,
            &params.remote_block_group_lens,
        ) {
            Ok(groups) if groups.len() > 1 => groups
                .iter()
                .map(|group| group.iter().map(|&id| id as u64).collect())
                .collect(),
            _ => vec![ids],
        };
        let count = |n: Option<usize>| n.and_then(|n| u32::try_from(n).ok());
        VllmKvTransferParams {
            do_remote_prefill: Some(params.do_remote_prefill),
            do_remote_decode: Some(params.do_remote_decode),
            remote_block_ids: (params.remote_engine_id.is_some()
                || !params.remote_block_ids.is_empty()
                || !params.remote_block_group_lens.is_empty())
            .then_some(VllmBlockIds::Groups(groups)),
            remote_engine_id: params.remote_engine_id.clone(),
            remote_request_id: params.remote_request_id.clone(),
            remote_host: params.remote_host.clone(),
            remote_port: params.remote_port,
            tp_size: count(params.remote_tp_size),
            dcp_size: count(params.remote_dcp_size),
            pp_size: count(params.remote_pp_size),
            remote_num_tokens: params.remote_num_tokens.map(|n| n as u64),
            remote_blocks_expiry_time: params.remote_blocks_expiry_time,
            remote_registration_generation: params.remote_registration_generation,
            transfer_mode: params.transfer_mode.clone(),
            other: params.vllm_extra.clone(),
        }
    }
}

impl KvTransferParams {
    /// Parses vLLM's JSON `kv_transfer_params` (see
    /// [`VllmKvTransferParams::from_json`] and the conversion's refusals).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the key that is wrong, or what is not supported.
    pub fn from_vllm_json(json: &str) -> Result<Self> {
        KvTransferParams::try_from(&VllmKvTransferParams::from_json(json)?)
    }

    /// The params as vLLM's JSON `kv_transfer_params` (what vLLM's `request_finished`
    /// returns, and a proxy hands to the decode).
    pub fn to_vllm_json(&self) -> String {
        VllmKvTransferParams::from(self).to_json()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What vLLM 0.33's `request_finished` returns on a prefill (one KV cache group).
    const FROM_PREFILL: &str = r#"{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3, 4, 5]], "remote_engine_id": "pf-0", "remote_request_id": "cmpl-1-0-1a2b3c4d", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40, "remote_blocks_expiry_time": null, "remote_registration_generation": 1, "transfer_mode": "pull"}"#;

    fn value(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn json_round_trips_losslessly() {
        for json in [
            FROM_PREFILL,
            r#"{"do_remote_decode": true}"#,
            r#"{"do_remote_decode": true, "remote_engine_id": null, "remote_block_ids": null, "_remote_blocks_processed": true}"#,
            r#"{"remote_block_ids": [1, 2], "remote_blocks_expiry_time": 1234.5, "x": {"y": [1, "z"]}}"#,
            r#"{"remote_block_ids": []}"#,
            r#"{"remote_block_ids": [[], [7, 8]]}"#,
            r#"{}"#,
        ] {
            let params = VllmKvTransferParams::from_json(json).unwrap();
            assert_eq!(value(&params.to_json()), value(json), "{json}");
        }
        let params = VllmKvTransferParams::from_json(FROM_PREFILL).unwrap();
        assert_eq!(
            params.remote_block_ids,
            Some(VllmBlockIds::Groups(vec![vec![3, 4, 5]]))
        );
        assert_eq!(params.remote_blocks_expiry_time, None);
        assert_eq!(
            params.other.get("remote_blocks_expiry_time"),
            Some(&Value::Null)
        );
        assert_eq!(params.remote_port, Some(5600));
    }

    #[test]
    fn every_known_key_is_read_and_written_by_its_field() {
        let every_key = r#"{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[3]], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "tp_size": 2, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 4, "remote_blocks_expiry_time": 5.5, "remote_registration_generation": 6, "transfer_mode": "pull"}"#;
        let every = value(every_key);
        let keys: Vec<&str> = every
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut known = KNOWN_KEYS.to_vec();
        known.sort_unstable();
        let mut named = keys.clone();
        named.sort_unstable();
        assert_eq!(named, known, "the JSON above names every known key once");
        let params = VllmKvTransferParams::from_json(every_key).unwrap();
        assert!(params.other.is_empty(), "{:?}", params.other);
        assert_eq!(value(&params.to_json()), every);
        for key in KNOWN_KEYS {
            let json = format!(r#"{{"{key}": null}}"#);
            let params = VllmKvTransferParams::from_json(&json).unwrap();
            assert_eq!(params.other.get(*key), Some(&Value::Null), "{key}");
            assert_eq!(unknown_keys(&params.other).count(), 0, "{key} is known");
        }
    }

    #[test]
    fn unknown_keys_are_kept_and_logged_once() {
        let json = r#"{"remote_port": null, "a_key_for_this_test": 1, "tp_size": 2}"#;
        let params = VllmKvTransferParams::from_json(json).unwrap();
        assert_eq!(
            unknown_keys(&params.other).collect::<Vec<_>>(),
            ["a_key_for_this_test"]
        );
        assert_eq!(value(&params.to_json()), value(json));
        let logged = UNKNOWN_KEYS_LOGGED.lock().unwrap();
        assert!(logged.contains("a_key_for_this_test"));
        assert!(!logged.contains("remote_port") && !logged.contains("tp_size"));
    }

    #[test]
    fn wrong_types_name_their_key() {
        for (json, key) in [
            (r#"{"remote_port": 70000}"#, "remote_port"),
            (r#"{"remote_port": "5600"}"#, "remote_port"),
            (r#"{"tp_size": -1}"#, "tp_size"),
            (r#"{"remote_block_ids": [1, [2]]}"#, "block ids"),
            (r#"{"remote_block_ids": [[1], [-2]]}"#, "group"),
            (r#"{"do_remote_prefill": 1}"#, "do_remote_prefill"),
        ] {
            let err = VllmKvTransferParams::from_json(json)
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{json}: {err}");
        }
        assert!(VllmKvTransferParams::from_json("[1]").is_err());
    }

    #[test]
    fn converts_to_and_from_the_connectors_params_losslessly() {
        let params = VllmKvTransferParams::from_json(FROM_PREFILL).unwrap();
        let native = KvTransferParams::try_from(&params).unwrap();
        assert!(native.do_remote_prefill && !native.do_remote_decode);
        assert_eq!(native.remote_block_ids, vec![3, 4, 5]);
        assert_eq!(native.remote_tp_size, Some(2));
        assert_eq!(native.remote_num_tokens, Some(40));
        assert_eq!(native.remote_registration_generation, Some(1));
        let remote = native.remote_blocks().unwrap();
        assert_eq!(
            (
                remote.engine_id.as_str(),
                remote.host.as_str(),
                remote.port,
                remote.request_id.as_str()
            ),
            ("pf-0", "10.0.0.1", 5600, "cmpl-1-0-1a2b3c4d")
        );
        // vLLM's JSON, through the connector's params, back to the same JSON: every key,
        // the nulls and the keys it does not know too.
        for json in [
            FROM_PREFILL,
            r#"{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1]], "remote_engine_id": "e", "remote_blocks_expiry_time": 1234.5, "a_newer_key": {"x": [1, null]}, "tp_size": null}"#,
            r#"{"do_remote_prefill": false, "do_remote_decode": true}"#,
        ] {
            let native = KvTransferParams::from_vllm_json(json).unwrap();
            assert_eq!(value(&native.to_vllm_json()), value(json), "{json}");
        }
        // The connector's params, through vLLM's JSON, back to the same params.
        let full = KvTransferParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_engine_id: Some("p".into()),
            remote_host: Some("h".into()),
            remote_port: Some(7),
            remote_block_ids: vec![9, 1],
            remote_block_group_lens: Vec::new(),
            remote_request_id: Some("r".into()),
            remote_tp_size: Some(4),
            remote_num_tokens: Some(33),
            remote_dcp_size: Some(1),
            remote_pp_size: Some(1),
            remote_blocks_expiry_time: Some(0.1 + 0.2),
            remote_registration_generation: Some(u64::MAX),
            transfer_mode: Some("pull".into()),
            remote_capability: None,
            remote_lease_epoch: None,
            vllm_extra: Map::from_iter([("k".to_string(), Value::from(vec![1.5, -2.0]))]),
        };
        let hybrid = KvTransferParams {
            remote_block_ids: vec![9, 1, 4],
            remote_block_group_lens: vec![2, 0, 1],
            ..full.clone()
        };
        for native in [full, hybrid, KvTransferParams::default()] {
            let back = KvTransferParams::from_vllm_json(&native.to_vllm_json()).unwrap();
            assert_eq!(back, native);
        }
        // A hybrid model's groups, flattened, and back.
        let json = r#"{"remote_block_ids": [[3, 4], [], [9]], "remote_engine_id": "e"}"#;
        let hybrid = KvTransferParams::from_vllm_json(json).unwrap();
        assert_eq!(hybrid.remote_block_ids, vec![3, 4, 9]);
        assert_eq!(hybrid.remote_block_group_lens, vec![2, 0, 1]);
        assert_eq!(
            value(&hybrid.to_vllm_json())["remote_block_ids"],
            value("[[3, 4], [], [9]]")
        );
        let empty = KvTransferParams::from_vllm_json(r#"{"remote_block_ids": [[], []]}"#).unwrap();
        assert_eq!(
            value(&empty.to_vllm_json())["remote_block_ids"],
            value("[[], []]")
        );
        // Older vLLM's flat block ids come back as one group.
        let flat = KvTransferParams::from_vllm_json(r#"{"remote_block_ids": [9]}"#).unwrap();
        assert_eq!(flat.remote_block_ids, vec![9]);
        assert_eq!(
            value(&flat.to_vllm_json())["remote_block_ids"],
            value("[[9]]")
        );
    }

    #[test]
    fn what_the_connector_cannot_do_is_refused() {
        for (json, expect) in [
            (r#"{"pp_size": 0}"#, "pp_size 0: 1 to 256 stages"),
            (r#"{"pp_size": 257}"#, "pp_size 257"),
            (r#"{"dcp_size": 0}"#, "dcp_size 0: 1 to 256 ranks"),
            (r#"{"dcp_size": 257}"#, "dcp_size 257"),
            (
                r#"{"transfer_mode": "sideways"}"#,
                "\"sideways\" is not a transfer mode",
            ),
        ] {
            let params = VllmKvTransferParams::from_json(json).unwrap();
            let err = KvTransferParams::try_from(&params).unwrap_err().to_string();
            assert!(err.contains(expect), "{json}: {err}");
        }
    }
}
