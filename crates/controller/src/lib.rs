//! ferry's fleet controller: it knows the fleet's sites, hosts (agents heartbeat to it), VMs
//! and every migration, keeps them in a store (SQLite, or PostgreSQL shared by several
//! controllers, one of which leads), and hands migrations to the source hosts' agents.

pub mod api;
pub mod client;
pub mod config;
pub mod cost_model;
pub mod fleet;
pub mod groups;
pub mod overload;
pub mod plan;
pub mod pools;
pub mod serve;
pub mod store;
