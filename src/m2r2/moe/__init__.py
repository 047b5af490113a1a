"""Mixture-of-Experts support: MoEfication of dense models (:mod:`m2r2.moe.moefy`) and the offloading
runtime (expert store, fast-memory cache, loader thread, prefetch policies).

The MoE layer itself lives in :mod:`m2r2.model` (:class:`m2r2.model.MoE`, :class:`m2r2.model.ExpertSource`).
Submodules are imported explicitly so that importing this package stays cheap.
"""
