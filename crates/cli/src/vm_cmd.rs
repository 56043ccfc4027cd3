//! `ferry vm start | stop | list` and `ferry guest`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, Subcommand};
use ferry_lab::bench::Workload;
use ferry_lab::guest::{GuestLink, Heartbeats};
use ferry_lab::{accel, vm, Lab, Site};

/// VM shape and workload flags shared by `vm start`, `bench` and `demo`.
#[derive(Args, Debug, Clone)]
pub struct VmShape {
    /// Guest memory, MiB.
    #[arg(long, default_value_t = 256)]
    pub mem_mib: u32,
    /// Virtual CPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u32,
    /// Attach a small ext4 data disk (64 MiB): ferry's agents move it with the VM, or with
    /// --system qemu QEMU's mirror copies it straight to the destination's NBD export.
    #[arg(long)]
    pub disk: bool,
    /// A data disk of this many MiB instead (a fresh ext4 file system; implies --disk).
    #[arg(long)]
    pub disk_mib: Option<u32>,
    /// Make the data disk an overlay on a template, holding this many MiB of data, that every
    /// site's image library holds (implies --disk; ferry then copies the overlay only).
    #[arg(long)]
    pub disk_template_mib: Option<u32>,
    /// How many images deep that template is: each layer above its base is a qcow2 overlay
    /// adding a 4 MiB file (the libraries hold the whole chain).
    #[arg(long, default_value_t = 1, requires = "disk_template_mib")]
    pub disk_template_layers: u32,
}

impl VmShape {
    /// Whether the VM gets a data disk.
    pub fn has_disk(&self) -> bool {
        self.disk || self.disk_mib.is_some() || self.disk_template_mib.is_some()
    }

    /// Checks the disk size.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(mib) = self.disk_mib {
            if !(16..=1 << 20).contains(&mib) {
                anyhow::bail!("--disk-mib {mib} is out of range; use 16 to 1048576");
            }
        }
        if let Some(data) = self.disk_template_mib {
            let disk = self.disk_mib.unwrap_or(64);
            if data == 0 || data + 16 > disk {
                anyhow::bail!(
                    "--disk-template-mib {data} must be at least 1 and leave 16 MiB of the {disk} MiB disk"
                );
            }
            let layers = self.disk_template_layers;
            if !(1..=8).contains(&layers) || data + (layers - 1) * vm::LAYER_MIB + 16 > disk {
                anyhow::bail!(
                    "--disk-template-layers {layers} must be 1 to 8, and with {} MiB each above \
                     the base leave 16 MiB of the {disk} MiB disk",
                    vm::LAYER_MIB
                );
            }
        }
        Ok(())
    }

    /// The lab's options for a VM of this shape.
    pub fn vm_options(&self, accel: ferry_qemu::Accel) -> vm::VmOptions {
        vm::VmOptions {
            mem_mib: self.mem_mib,
            vcpus: self.vcpus,
            disk: self.has_disk(),
            disk_mib: self.disk_mib,
            disk_template_mib: self.disk_template_mib,
            disk_template_layers: self.disk_template_layers,
            accel,
        }
    }
}

#[derive(Subcommand)]
pub enum VmCmd {
    /// Boot a VM from the lab's tiny guest image.
    Start {
        name: String,
        /// Site to start at.
        #[arg(long, default_value = "a")]
        site: String,
        #[command(flatten)]
        shape: VmShape,
        /// Start a memory workload: zero, delta, ws, hot or idle.
        #[arg(long)]
        workload: Option<String>,
        /// Memory the workload owns, MiB.
        #[arg(long, default_value_t = 64)]
        dirty_mib: u32,
        /// Dirtying rate, MiB/s (0: as fast as the guest can).
        #[arg(long, default_value_t = 4.0)]
        dirty_rate_mib_s: f64,
    },
    /// Stop a VM and delete it.
    Stop { name: String },
    /// List the lab's VMs.
    List,
}

/// `ferry guest NAME COMMAND...`
#[derive(Args)]
pub struct GuestArgs {
    name: String,
    /// The guest command, e.g. `mem verify` or `mem set rate=20`.
    #[arg(required = true, trailing_var_arg = true)]
    command: Vec<String>,
}

pub async fn run(cmd: VmCmd) -> Result<ExitCode> {
    let lab = Lab::from_env();
    match cmd {
        VmCmd::Start {
            name,
            site,
            shape,
            workload,
            dirty_mib,
            dirty_rate_mib_s,
        } => {
            let site = Site::parse(&site)?;
            lab.state()?;
            let workload = workload.map(|pattern| Workload {
                pattern,
                dirty_mib,
                rate_mib_s: dirty_rate_mib_s,
            });
            shape.validate()?;
            if let Some(w) = &workload {
                w.validate(shape.mem_mib)?;
            }
            let img = tokio::task::spawn_blocking(vm::ensure_image).await??;
            let (accel, why) = tokio::task::spawn_blocking({
                let img = img.clone();
                move || accel::detect(&img)
            })
            .await??;
            let opts = shape.vm_options(accel);
            let rec = vm::start(&lab, &name, site, &opts, &img).await?;
            println!(
                "VM {name} started at site {} ({}: {why}); guest address {}",
                site.name(),
                accel.as_str(),
                rec.guest_ip
            );
            let link = GuestLink::connect(&rec.spec.serial_socket, Arc::new(Heartbeats::default()))
                .await?;
            link.wait_ready(Duration::from_secs(120)).await?;
            println!("guest agent ready");
            if let Some(w) = workload {
                link.call(&w.start_command(), Duration::from_secs(180))
                    .await?;
                println!(
                    "workload {} started on {} MiB at {} MiB/s",
                    w.pattern, w.dirty_mib, w.rate_mib_s
                );
            }
        }
        VmCmd::Stop { name } => {
            vm::stop(&lab, &name)?;
            println!("VM {name} stopped");
        }
        VmCmd::List => {
            for v in vm::list(&lab)? {
                println!(
                    "{}\tsite {}\t{} MiB\t{}\tpid {}",
                    v.name,
                    v.site.name(),
                    v.spec.mem_mib,
                    v.guest_ip,
                    v.pid
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn guest(args: GuestArgs) -> Result<ExitCode> {
    let lab = Lab::from_env();
    let rec = vm::load(&lab, &args.name)?;
    let link = GuestLink::connect(&rec.spec.serial_socket, Arc::new(Heartbeats::default())).await?;
    let reply = link
        .call(&args.command.join(" "), Duration::from_secs(300))
        .await?;
    println!("{}", reply.text);
    Ok(ExitCode::SUCCESS)
}
