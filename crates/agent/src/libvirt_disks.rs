//! A domain's file disks as libvirt describes them (`virsh dumpxml`): each disk's alias,
//! the NBD export libvirt names after it for a migration's disk copy, and its image with the
//! backing files under it.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// One file-backed disk of a running domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSource {
    /// libvirt's device alias (`virtio-disk0`).
    pub alias: String,
    /// The image first, then its backing files in order.
    pub chain: Vec<PathBuf>,
}

impl DiskSource {
    /// The export libvirt's migration asks the destination QEMU's NBD server for, and so
    /// the one the source's mirror names (`drive-<alias>`, libvirt's `qemuAliasDiskDriveFromDisk`).
    pub fn export(&self) -> String {
        format!("drive-{}", self.alias)
    }
}

/// The file disks in a live domain's XML whose whole chain is files libvirt names; a disk
/// with a network or block source anywhere in its chain, or without an alias, is left out.
pub fn parse(xml: &str) -> Result<Vec<DiskSource>> {
    let doc = roxmltree::Document::parse(xml).context("libvirt's domain XML")?;
    let disks = doc
        .descendants()
        .filter(|n| n.has_tag_name("disk") && n.parent().is_some_and(|p| p.has_tag_name("devices")))
        .filter(|n| n.attribute("device").unwrap_or("disk") == "disk");
    Ok(disks.filter_map(file_disk).collect())
}

fn file_disk(disk: roxmltree::Node) -> Option<DiskSource> {
    let alias = child(disk, "alias")?.attribute("name")?.to_owned();
    let mut chain = Vec::new();
    let mut level = disk;
    loop {
        if level.attribute("type") != Some("file") {
            return None;
        }
        chain.push(PathBuf::from(child(level, "source")?.attribute("file")?));
        match child(level, "backingStore") {
            // `<backingStore/>`: the chain ends here.
            Some(next) if next.has_children() => level = next,
            _ => break,
        }
    }
    Some(DiskSource { alias, chain })
}

fn child<'a, 'i>(node: roxmltree::Node<'a, 'i>, tag: &str) -> Option<roxmltree::Node<'a, 'i>> {
    node.children().find(|c| c.has_tag_name(tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As libvirt 11.3 prints a running domain: a qcow2 over a backing file, a CD-ROM, a
    /// network disk.
    const XML: &str = r#"<domain type='qemu' id='3'>
  <name>lv6</name>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='/run/ferry-host/lv6.qcow2' index='2'/>
      <backingStore type='file' index='1'>
        <format type='qcow2'/>
        <source file='/var/lib/images/base.qcow2'/>
        <backingStore/>
      </backingStore>
      <target dev='vda' bus='virtio'/>
      <alias name='virtio-disk0'/>
    </disk>
    <disk type='file' device='cdrom'>
      <source file='/tmp/seed.iso'/>
      <target dev='sda' bus='sata'/>
      <alias name='sata0-0-0'/>
    </disk>
    <disk type='network' device='disk'>
      <source protocol='nbd' name='x'><host name='h'/></source>
      <target dev='vdb' bus='virtio'/>
      <alias name='virtio-disk1'/>
    </disk>
    <disk type='file' device='disk'>
      <source file='/data/plain.raw'/>
      <backingStore/>
      <target dev='vdc' bus='virtio'/>
      <alias name='virtio-disk2'/>
    </disk>
  </devices>
</domain>"#;

    #[test]
    fn file_disks_are_listed_with_their_backing_chains() {
        let disks = parse(XML).unwrap();
        assert_eq!(
            disks,
            vec![
                DiskSource {
                    alias: "virtio-disk0".into(),
                    chain: vec![
                        "/run/ferry-host/lv6.qcow2".into(),
                        "/var/lib/images/base.qcow2".into()
                    ],
                },
                DiskSource {
                    alias: "virtio-disk2".into(),
                    chain: vec!["/data/plain.raw".into()],
                },
            ]
        );
        assert_eq!(disks[0].export(), "drive-virtio-disk0");
    }

    #[test]
    fn a_chain_with_a_network_layer_is_left_out() {
        let xml = XML.replace(
            "<backingStore type='file' index='1'>",
            "<backingStore type='network' index='1'>",
        );
        let aliases: Vec<String> = parse(&xml).unwrap().into_iter().map(|d| d.alias).collect();
        assert_eq!(aliases, ["virtio-disk2"]);
    }

    #[test]
    fn xml_that_does_not_parse_says_so() {
        let e = parse("<domain>").unwrap_err();
        assert!(
            format!("{e:#}").starts_with("libvirt's domain XML"),
            "{e:#}"
        );
    }
}
