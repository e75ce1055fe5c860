"""LUMI (CSC, Finland): LUMI-G nodes with 4 MI250X modules (8 GCDs) on HPE Slingshot-11.

Detected by /appl/lumi or any LUMI_* variable (set by the LUMI software stack).
"""
import os
from pathlib import Path

from envs import computed as c
from envs.profiles import refs
from envs.spec import Profile, computed, setting


def detect(environ=os.environ, root: Path = Path("/")) -> bool:
    return (root / "appl/lumi").is_dir() or any(k.startswith("LUMI_") for k in environ)


PROFILE = Profile("lumi", "site", "LUMI-G (MI250X, Slingshot-11)", (
    setting("NCCL_SOCKET_IFNAME", "hsn0,hsn1,hsn2,hsn3",
            "the four Slingshot interfaces only: RCCL otherwise tries nmn0, which it cannot use",
            f"{refs.LUMI_AI_GUIDE}; {refs.LUMI_SLIDES}"),
    setting("GLOO_SOCKET_IFNAME", "hsn0",
            "keep gloo off the management network nmn0 as well",
            refs.LUMI_SLIDES),
    setting("NCCL_NET_GDR_LEVEL", "PHB",
            "GPU RDMA through the CXI plugin (2x bandwidth); PHB = 3, the user guide's value; default from ROCm 6.2",
            f"{refs.LUMI_AI_GUIDE}; {refs.LUMI_USER_GUIDE}"),
    computed("MIOPEN_USER_DB_PATH", c.miopen_cache_dir,
             "MIOpen's SQLite databases lock badly on the shared file system: one node-local copy per node",
             f"{refs.LUMI_SLIDES}; {refs.LUMI_USER_GUIDE}"),
    computed("MIOPEN_CUSTOM_CACHE_DIR", c.miopen_cache_dir,
             "MIOpen's kernel cache beside its database, node-local for the same reason",
             f"{refs.LUMI_SLIDES}; {refs.LUMI_USER_GUIDE}"),
    setting("CXI_FORK_SAFE", "1", "data-loader workers fork; make the CXI provider fork-safe",
            refs.LUMI_USER_GUIDE),
    setting("CXI_FORK_SAFE_HP", "1", "fork safety for huge-page registrations as well",
            refs.LUMI_USER_GUIDE),
    setting("FI_CXI_DISABLE_CQ_HUGETLB", "1", "libfabric CXI completion queues without huge pages (LUMI's setting)",
            refs.LUMI_USER_GUIDE),
))
