//! Layers by name: the model layers sharing each registered region and each one's KV cache
//! group (vLLM's `region_members` and `transfer_group_index_by_layer`), and the pairing of
//! two ranks' regions layer by layer, by name (vLLM's `_align_remote_regions_by_layer`).
//!
//! A hybrid model split over pipeline stages needs it: vLLM lays a stage's tensors out from
//! that stage's layers of each group (tensor `i` shared by layer `i` of every group), so a
//! stage's region may hold layers that sit in different regions of an engine of one stage.
//! Pairing regions by index from an offset would move another layer's bytes; by name, each
//! layer moves from its region into the peer's region holding it, with its group's blocks.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The most layer names a rank may declare (its own, or a peer's in a handshake).
pub const MAX_LAYER_NAMES: usize = 1 << 14;

/// The longest layer name accepted, in bytes.
pub const MAX_LAYER_NAME_LEN: usize = 512;

/// One layer of a registered region: its name (vLLM's layer name, e.g.
/// `"model.layers.3.self_attn.attn"`) and its KV cache group's index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionLayer {
    /// The layer's name, the same on every engine serving the model.
    pub layer: String,
    /// Its KV cache group, an index into the engine's groups.
    pub group: usize,
}

/// How one layer moves between two ranks: from (or into) `local_region` here and
/// `remote_region` on the peer, with the blocks of the local layer `local_layer`'s group (its
/// index among the local rank's layers, region by region).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRoute {
    /// The local region holding the layer.
    pub local_region: usize,
    /// The peer's region holding it.
    pub remote_region: usize,
    /// The layer's index among the local rank's layers.
    pub local_layer: usize,
}

/// Checks an engine's `region_layers` for `groups` KV cache groups: each layer's group one
/// of them, no name twice, an empty region, or past [`MAX_LAYER_NAMES`] or
/// [`MAX_LAYER_NAME_LEN`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming the first that is wrong.
pub(crate) fn check_region_layers(region_layers: &[Vec<RegionLayer>], groups: usize) -> Result<()> {
    const OP: &str = "KV cache groups' region_layers";
    let names: Vec<Vec<&str>> = region_layers
        .iter()
        .map(|region| region.iter().map(|l| l.layer.as_str()).collect())
        .collect();
    index_names(&names).map_err(|why| Error::invalid(OP, why))?;
    for (region, layers) in region_layers.iter().enumerate() {
        if let Some(layer) = layers.iter().find(|l| l.group >= groups) {
            return Err(Error::invalid(
                OP,
                format!(
                    "region {region}: layer {:?} of group {}, the engine has {groups} groups",
                    layer.layer, layer.group
                ),
            ));
        }
    }
    Ok(())
}

/// Each layer name of `regions` and its (region, index among all the layers), checked: no
/// empty region, no name twice, at most [`MAX_LAYER_NAMES`] names of at most
/// [`MAX_LAYER_NAME_LEN`] bytes.
fn index_names<S: AsRef<str>>(
    regions: &[Vec<S>],
) -> std::result::Result<HashMap<&str, (usize, usize)>, String> {
    let total = regions
        .iter()
        .fold(0usize, |n, r| n.saturating_add(r.len()));
    if total > MAX_LAYER_NAMES {
        return Err(format!("{total} layer names (at most {MAX_LAYER_NAMES})"));
    }
    let mut index = HashMap::with_capacity(total);
    for (region, names) in regions.iter().enumerate() {
        if names.is_empty() {
            return Err(format!("region {region} names no layer"));
        }
        for name in names {
            let name = name.as_ref();
            if name.is_empty() || name.len() > MAX_LAYER_NAME_LEN {
                return Err(format!(
                    "region {region}: a layer name of {} bytes (1 to {MAX_LAYER_NAME_LEN})",
                    name.len()
                ));
            }
            let at = (region, index.len());
            if index.insert(name, at).is_some() {
                return Err(format!("layer {name:?} is named in two regions"));
            }
        }
    }
    Ok(index)
}

/// Pairs the layers of `local` and `remote` (each rank's layer names, region by region) by
/// name: one [`LayerRoute`] per layer both hold, in the local rank's layer order. The side
/// of one stage (`*_one_stage`) holds the whole model, so every layer of the other must be
/// in it (vLLM asserts this; routing past a missing layer would leave stale KV); two sides
/// of several stages are not paired by name.
///
/// # Errors
/// Why not, with the names: either side's names not valid (no names, an empty region, a
/// name twice, too many or too long), a layer of the side of stages missing on the other,
/// or both sides of several stages.
pub(crate) fn route_by_layer_name<S: AsRef<str>>(
    (local, local_one_stage): (&[Vec<S>], bool),
    (remote, remote_one_stage): (&[Vec<S>], bool),
) -> std::result::Result<Vec<LayerRoute>, String> {
    if !local_one_stage && !remote_one_stage {
        return Err("two engines of several pipeline stages are not paired by layer name: vLLM's push routes by name from a prefill of stages into a decode of one".to_string());
    }
    if remote.is_empty() {
        return Err("the peer names no layer of its regions (vLLM's region_members): a prefill of stages of a hybrid model matches regions by layer name, and pairing them by index would move another layer's KV".to_string());
    }
    let ours = index_names(local).map_err(|why| format!("this rank's region layers: {why}"))?;
    let theirs = index_names(remote).map_err(|why| format!("the peer's region_members: {why}"))?;
    fn missing(
        of: &HashMap<&str, (usize, usize)>,
        in_: &HashMap<&str, (usize, usize)>,
    ) -> Vec<String> {
        let mut missing: Vec<String> = of
            .keys()
            .filter(|n| !in_.contains_key(*n))
            .map(|n| n.to_string())
            .collect();
        missing.sort_unstable();
        missing.truncate(4);
        missing
    }
    if remote_one_stage {
        let lacking = missing(&ours, &theirs);
        if !lacking.is_empty() {
            return Err(format!("the peer lacks this rank's layers {lacking:?}: both engines must serve the same model with the same layer names"));
        }
    }
    if local_one_stage {
        let lacking = missing(&theirs, &ours);
        if !lacking.is_empty() {
            return Err(format!("this rank lacks the peer's layers {lacking:?}: both engines must serve the same model with the same layer names"));
        }
    }
    let mut routes: Vec<LayerRoute> = ours
        .iter()
        .filter_map(|(name, &(local_region, local_layer))| {
            theirs.get(name).map(|&(remote_region, _)| LayerRoute {
                local_region,
                remote_region,
                local_layer,
            })
        })
        .collect();
    routes.sort_unstable_by_key(|r| r.local_layer);
    Ok(routes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layer names, region by region.
    type Names = Vec<Vec<String>>;

    fn names(regions: &[&[&str]]) -> Names {
        regions
            .iter()
            .map(|r| r.iter().map(|n| n.to_string()).collect())
            .collect()
    }

    /// vLLM's layout of six layers, full attention at the even ones and a sliding window at
    /// the odd ones: tensor `i` holds layer `i` of each group, on every engine from its
    /// own layers.
    fn decode() -> Names {
        names(&[&["l0", "l1"], &["l2", "l3"], &["l4", "l5"]])
    }

    #[test]
    fn a_stages_layers_land_in_the_regions_holding_them_by_name() {
        // Stage 1 of 2 holds layers 3, 4, 5: group 0 has [l4], group 1 [l3, l5], so its
        // tensors are {l4, l3} and {l5}.
        let stage = names(&[&["l4", "l3"], &["l5"]]);
        let routes = route_by_layer_name((&stage, false), (&decode(), true)).unwrap();
        let pairs: Vec<(usize, usize, usize)> = routes
            .iter()
            .map(|r| (r.local_layer, r.local_region, r.remote_region))
            .collect();
        assert_eq!(pairs, [(0, 0, 2), (1, 0, 1), (2, 1, 2)]);
        // The decode's view of the same stage: the layers both hold, in its order.
        let routes = route_by_layer_name((&decode(), true), (&stage, false)).unwrap();
        let pairs: Vec<(usize, usize, usize)> = routes
            .iter()
            .map(|r| (r.local_layer, r.local_region, r.remote_region))
            .collect();
        assert_eq!(pairs, [(3, 1, 0), (4, 2, 0), (5, 2, 1)]);
    }

    #[test]
    fn what_cannot_pair_by_name_is_refused_by_name() {
        let stage = names(&[&["l4", "l3"], &["l5"]]);
        let cases: [(Names, Names, &str); 6] = [
            (stage.clone(), Vec::new(), "names no layer"),
            (
                stage.clone(),
                names(&[&["l0", "l1"], &["l2", "l3"]]),
                "lacks this rank's layers [\"l4\", \"l5\"]",
            ),
            (
                stage.clone(),
                names(&[&["l3"], &["l4", "l5", "l3"]]),
                "\"l3\" is named in two regions",
            ),
            (
                stage.clone(),
                names(&[&["l3", "l4", "l5"], &[]]),
                "region 1 names no layer",
            ),
            (
                names(&[&["l4"], &[""]]),
                decode(),
                "a layer name of 0 bytes",
            ),
            (
                stage.clone(),
                vec![vec!["x".repeat(MAX_LAYER_NAME_LEN + 1)]],
                "a layer name of 513 bytes",
            ),
        ];
        for (local, remote, want) in cases {
            let err = route_by_layer_name((&local, false), (&remote, true)).unwrap_err();
            assert!(err.contains(want), "{err}");
        }
        let err = route_by_layer_name((&stage, false), (&stage, false)).unwrap_err();
        assert!(err.contains("several pipeline stages"), "{err}");
        let many = vec![vec!["a".to_string(); MAX_LAYER_NAMES + 1]];
        let err = route_by_layer_name((&stage, false), (&many, true)).unwrap_err();
        assert!(err.contains("16385 layer names"), "{err}");
    }

    /// Any names on either side, one of several stages: a refusal, or one route per layer
    /// both hold, in the local layer order, each between the regions naming it.
    #[test]
    fn any_names_route_within_both_sides_or_are_refused() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let (mut routed, mut refused) = (0, 0);
        for _ in 0..20_000 {
            // Each side some of a model's layers in regions of 1 to 3, now and then with a
            // name twice, an empty region or a layer of another model.
            let layers = 1 + below(8);
            let mut sides: [Names; 2] = Default::default();
            for side in &mut sides {
                let mut names: Vec<String> = (0..layers)
                    .filter(|_| below(4) > 0)
                    .map(|l| format!("l{l}"))
                    .collect();
                match below(12) {
                    0 if !names.is_empty() => names.push(names[0].clone()),
                    1 => names.push("other".into()),
                    _ => {}
                }
                while !names.is_empty() {
                    let take = (1 + below(3)).min(names.len());
                    side.push(names.drain(..take).collect());
                }
                if below(12) == 0 {
                    side.push(Vec::new());
                }
            }
            let [local, remote] = sides;
            let stages = below(3);
            let (local_one, remote_one) = (stages != 1, stages != 2);
            let Ok(routes) = route_by_layer_name((&local, local_one), (&remote, remote_one)) else {
                refused += 1;
                continue;
            };
            routed += 1;
            let flat: Vec<(usize, &String)> = local
                .iter()
                .enumerate()
                .flat_map(|(r, names)| names.iter().map(move |n| (r, n)))
                .collect();
            let held = |name: &String| remote.iter().any(|r| r.contains(name));
            let both: Vec<usize> = (0..flat.len()).filter(|&k| held(flat[k].1)).collect();
            let layers: Vec<usize> = routes.iter().map(|r| r.local_layer).collect();
            assert_eq!(layers, both, "{local:?} {remote:?}");
            for route in &routes {
                let (region, name) = flat[route.local_layer];
                assert_eq!(route.local_region, region);
                assert!(remote[route.remote_region].contains(name));
            }
        }
        assert!(
            routed > 1000 && refused > 1000,
            "{routed} routed, {refused} refused"
        );
    }

    #[test]
    fn an_engines_region_layers_name_its_groups() {
        let layer = |name: &str, group| RegionLayer {
            layer: name.into(),
            group,
        };
        let good = vec![vec![layer("l0", 0), layer("l1", 1)], vec![layer("l2", 0)]];
        check_region_layers(&good, 2).unwrap();
        let err = check_region_layers(&good, 1).unwrap_err().to_string();
        assert!(
            err.contains("layer \"l1\" of group 1, the engine has 1 groups"),
            "{err}"
        );
        let twice = vec![vec![layer("l0", 0)], vec![layer("l0", 1)]];
        let err = check_region_layers(&twice, 2).unwrap_err().to_string();
        assert!(err.contains("named in two regions"), "{err}");
    }
}
