"""The base layer: what every Anvil run gets, whatever the GPU."""
from core import names
from envs import computed as c
from envs.profiles import refs
from envs.spec import Profile, computed, setting

PROFILE = Profile("base", "base", "every machine", (
    computed("NCCL_SOCKET_IFNAME", c.socket_ifname,
             "NCCL/RCCL bootstrap and socket traffic must leave through the interface that reaches the other nodes",
             f"{refs.PRIMUS_AUTO_NET}; {refs.NCCL_ENV_DOCS}"),
    computed("GLOO_SOCKET_IFNAME", c.socket_ifname,
             "gloo (CPU collectives, the CPU-only trainer) binds the same interface as NCCL",
             f"{refs.PRIMUS_BASE_ENV}; {refs.TORCH_DIST_DOCS}"),
    computed("NCCL_IB_HCA", c.ib_hca,
             "name exactly the RDMA ports that are up: NCCL fails on a listed port that is down",
             refs.PRIMUS_AUTO_NET),
    setting("NCCL_DEBUG", "WARN",
            "surface NCCL/RCCL warnings in rank logs without the INFO flood; use INFO to debug",
            refs.NCCL_ENV_DOCS),
    setting("TOKENIZERS_PARALLELISM", "false",
            "HF tokenizers' thread pool and forked data-loader workers do not mix",
            refs.NEMO_PERF),
    computed(names.HOST, c.hostname,
             "host name the trainer prints in its rank-aware log lines",
             f"Anvil trainer process contract (reads {names.HOST})"),
))
