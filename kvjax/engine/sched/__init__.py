"""Host scheduling: which requests run each step and which pages they hold.

pages (layer 0) are host page ids and the pool; prefix_cache / state_snapshots /
batching (6) share pages between requests, keep hybrids' states and pack rows into step
shapes; scheduler / burst / group_pages / request_pages / mask_release / draft_policy /
ngram (7) admit and preempt, plan multi-step decode bursts, keep each request's pages
in every KV layer group, release the pages a variant's mask hides, and choose drafts.
Pure host code (numpy): it decides indices, the device programs in kvjax/runtime/ use
them.
"""
