//! What the decode-step groupings ([`crate::product_groups`], [`crate::rope_writes`])
//! share: runs of consecutive scheduled nodes that one kernel computes in the place
//! of the run's last node, and the byte-overlap test that keeps such a run safe (no
//! other kernel runs between its nodes, so only its own writes could clobber what it
//! reads).

use rlx_ir::NodeId;
use rlx_opt::{Location, Plan};
use std::collections::{HashMap, HashSet};

/// The runs of one kind in a plan.
#[derive(Debug)]
pub(crate) struct Runs<G> {
    /// Each run, by the node in whose place it runs (its last in the schedule).
    pub at: HashMap<NodeId, G>,
    /// Nodes whose work a run does elsewhere.
    pub absorbed: HashSet<NodeId>,
}

impl<G> Default for Runs<G> {
    fn default() -> Self {
        Runs {
            at: HashMap::new(),
            absorbed: HashSet::new(),
        }
    }
}

impl<G> Runs<G> {
    /// Records `group` as the work of `members` (consecutive in the schedule, not
    /// empty): it runs in the place of the last, the others run nothing.
    pub fn add(&mut self, members: &[NodeId], group: G) {
        if let Some((&last, rest)) = members.split_last() {
            self.absorbed.extend(rest.iter().copied());
            self.at.insert(last, group);
        }
    }
}

/// A value's bytes: where the plan put it and how many.
pub(crate) fn span(plan: &Plan, id: NodeId) -> (Location, usize) {
    (plan.locations[id.index()], plan.shape(id).byte_size())
}

/// Whether a written span shares bytes with a read one or with another written one
/// (two writes of one kernel race).
pub(crate) fn any_overlap(written: &[(Location, usize)], read: &[(Location, usize)]) -> bool {
    let meet = |(a, an): (Location, usize), (b, bn): (Location, usize)| {
        a.region == b.region && a.offset < b.offset + bn && b.offset < a.offset + an
    };
    written.iter().enumerate().any(|(i, &w)| {
        read.iter().any(|&r| meet(w, r)) || written[i + 1..].iter().any(|&o| meet(w, o))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_opt::Region;

    #[test]
    fn spans_overlap_within_a_region_only_and_two_writes_of_one_span_race() {
        let at = |region, offset| Location { region, offset };
        let (arena, handle) = (Region::Arena, Region::Handle(0));
        // Adjacent spans do not overlap; one byte more does.
        assert!(!any_overlap(&[(at(arena, 0), 64)], &[(at(arena, 64), 64)]));
        assert!(any_overlap(&[(at(arena, 0), 65)], &[(at(arena, 64), 64)]));
        // The same offsets in different regions are different bytes.
        assert!(!any_overlap(&[(at(handle, 0), 64)], &[(at(arena, 0), 64)]));
        // Two writes of the same bytes (two caches that are one) race.
        assert!(any_overlap(
            &[(at(handle, 0), 64), (at(handle, 32), 8)],
            &[]
        ));
        assert!(!any_overlap(
            &[(at(handle, 0), 64), (at(Region::Handle(1), 0), 64)],
            &[]
        ));
    }

    #[test]
    fn a_run_is_recorded_at_its_last_node() {
        let ids: Vec<NodeId> = (3..6).map(NodeId::from_index).collect();
        let mut runs = Runs::default();
        runs.add(&ids, "group");
        assert_eq!(runs.at.len(), 1);
        assert_eq!(runs.at[&ids[2]], "group");
        assert_eq!(runs.absorbed, ids[..2].iter().copied().collect());
    }
}
