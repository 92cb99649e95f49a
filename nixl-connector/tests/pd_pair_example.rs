//! examples/pd_pair.rs, which the crate docs cite as the whole flow (both engines'
//! schedulers and workers, one request's KV cache moved and checked), runs in the suite:
//! its own code, included here.

#[path = "../examples/pd_pair.rs"]
mod pd_pair;

#[test]
fn the_pd_pair_example_runs_to_its_end() {
    pd_pair::main().expect("the example moves and checks the request's blocks");
}
