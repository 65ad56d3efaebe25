"""The campaign: its config, its Prefect flow and guard, how it is launched, resumed, rerun and deployed."""
