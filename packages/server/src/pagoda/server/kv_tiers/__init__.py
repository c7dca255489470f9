"""KV tiers: a host tier shared by the replicas on a host and a disk tier kept across restarts, behind the KV
connector API (`connector.KVConnector`) that the engine drives through its extension seam."""
