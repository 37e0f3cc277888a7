"""The Serve config and a local multi-node Ray cluster standing in for the draft and target GPU pools."""
