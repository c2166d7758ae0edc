//! A simulated device: device memory is host memory at made-up addresses, and copies run
//! only when a fence is waited on, so that a staging buffer reused too early, or a result
//! read before its copy finished, shows up as wrong bytes in the tests.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Device, DeviceError, Fence, PinnedBuf, Pitched};

#[derive(Debug)]
enum Direction {
    ToDevice,
    ToHost,
}

#[derive(Debug)]
struct Pending {
    fence: u64,
    direction: Direction,
    host: usize,
    copies: Vec<Pitched>,
}

#[derive(Debug, Default)]
struct Inner {
    allocations: BTreeMap<u64, Vec<u8>>,
    next_address: u64,
    queue: Vec<Pending>,
    next_fence: u64,
    enqueued: u64,
}

/// Host memory posing as a device (see the module docs).
#[derive(Debug, Default)]
pub struct SimDevice {
    inner: Mutex<Inner>,
    pinned_live: Arc<AtomicUsize>,
    pinned_peak: Arc<AtomicUsize>,
    pinned_allocations: AtomicUsize,
}

impl SimDevice {
    /// A device with no memory yet.
    #[must_use]
    pub fn new() -> Self {
        let d = SimDevice::default();
        d.lock().next_address = 0x1000;
        d
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Allocates `len` zeroed bytes of device memory; returns their address.
    pub fn alloc(&self, len: usize) -> u64 {
        let mut g = self.lock();
        let address = g.next_address;
        // A gap after each allocation, so that running past its end is caught.
        g.next_address += len as u64 + 4096;
        g.allocations.insert(address, vec![0; len]);
        address
    }

    /// Writes bytes into device memory (a synchronous upload, for setting tests up).
    ///
    /// # Errors
    /// [`DeviceError::OutOfBounds`] outside an allocation.
    pub fn write(&self, address: u64, bytes: &[u8]) -> Result<(), DeviceError> {
        let mut g = self.lock();
        let (base, mem) = find(&mut g.allocations, address, bytes.len())?;
        // Inside the allocation `find` returned, a `Vec` in memory.
        let at = crate::model::usize_of(address - base);
        mem[at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Reads bytes of device memory (a synchronous download, for checking tests).
    ///
    /// # Errors
    /// [`DeviceError::OutOfBounds`] outside an allocation.
    pub fn read(&self, address: u64, len: usize) -> Result<Vec<u8>, DeviceError> {
        let mut g = self.lock();
        let (base, mem) = find(&mut g.allocations, address, len)?;
        // Inside the allocation `find` returned, a `Vec` in memory.
        let at = crate::model::usize_of(address - base);
        Ok(mem[at..at + len].to_vec())
    }

    /// The most pinned bytes held at once so far.
    #[must_use]
    pub fn pinned_peak(&self) -> usize {
        self.pinned_peak.load(Ordering::Relaxed)
    }

    /// Pinned allocations made so far (staging reused across calls allocates nothing more).
    #[must_use]
    pub fn pinned_allocations(&self) -> usize {
        self.pinned_allocations.load(Ordering::Relaxed)
    }

    /// Pitched copies enqueued so far.
    #[must_use]
    pub fn copies_enqueued(&self) -> u64 {
        self.lock().enqueued
    }

    fn enqueue(&self, direction: Direction, host: usize, copies: &[Pitched]) -> Fence {
        let mut g = self.lock();
        g.next_fence += 1;
        let fence = g.next_fence;
        g.enqueued += copies.len() as u64;
        g.queue.push(Pending {
            fence,
            direction,
            host,
            copies: copies.to_vec(),
        });
        Fence(fence)
    }
}

/// The allocation holding `address..address+len`.
fn find(
    allocations: &mut BTreeMap<u64, Vec<u8>>,
    address: u64,
    len: usize,
) -> Result<(u64, &mut Vec<u8>), DeviceError> {
    let out = || DeviceError::OutOfBounds {
        address,
        len: len as u64,
    };
    let (base, mem) = allocations
        .range_mut(..=address)
        .next_back()
        .ok_or_else(out)?;
    if address + len as u64 > base + mem.len() as u64 {
        return Err(out());
    }
    Ok((*base, mem))
}

impl Device for SimDevice {
    fn pinned(&self, len: usize) -> Result<PinnedBuf, DeviceError> {
        let mem: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        let ptr = NonNull::new(Box::into_raw(mem).cast::<u8>()).unwrap_or(NonNull::dangling());
        self.pinned_allocations.fetch_add(1, Ordering::Relaxed);
        let live = self.pinned_live.fetch_add(len, Ordering::Relaxed) + len;
        self.pinned_peak.fetch_max(live, Ordering::Relaxed);
        let counter = Arc::clone(&self.pinned_live);
        let free = Box::new(move |p: NonNull<u8>, n: usize| {
            counter.fetch_sub(n, Ordering::Relaxed);
            if n > 0 {
                // SAFETY: the pointer and length came from Box::into_raw of a boxed slice.
                drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p.as_ptr(), n)) });
            }
        });
        // SAFETY: freshly allocated, owned by the PinnedBuf alone; an empty buffer is never
        // dereferenced beyond zero bytes.
        Ok(unsafe { PinnedBuf::from_raw(ptr, len, free) })
    }

    unsafe fn to_device(&self, host: *const u8, copies: &[Pitched]) -> Result<Fence, DeviceError> {
        Ok(self.enqueue(Direction::ToDevice, host as usize, copies))
    }

    unsafe fn to_host(&self, host: *mut u8, copies: &[Pitched]) -> Result<Fence, DeviceError> {
        Ok(self.enqueue(Direction::ToHost, host as usize, copies))
    }

    fn wait(&self, fence: Fence) -> Result<(), DeviceError> {
        let mut g = self.lock();
        let split = g.queue.partition_point(|p| p.fence <= fence.0);
        let due: Vec<Pending> = g.queue.drain(..split).collect();
        for p in due {
            for c in &p.copies {
                for z in 0..c.depth {
                    for y in 0..c.height {
                        let h = p.host + c.host_offset + z * c.host_slice_pitch + y * c.host_pitch;
                        let d =
                            c.device + z as u64 * c.device_slice_pitch + y as u64 * c.device_pitch;
                        let (base, mem) = find(&mut g.allocations, d, c.width)?;
                        // Inside the allocation `find` returned, a `Vec` in memory.
                        let at = crate::model::usize_of(d - base);
                        let dev = &mut mem[at..at + c.width];
                        // SAFETY: the caller of to_device/to_host guaranteed the host range
                        // is valid until this wait returns.
                        unsafe {
                            match p.direction {
                                Direction::ToDevice => std::ptr::copy_nonoverlapping(
                                    h as *const u8,
                                    dev.as_mut_ptr(),
                                    c.width,
                                ),
                                Direction::ToHost => std::ptr::copy_nonoverlapping(
                                    dev.as_ptr(),
                                    h as *mut u8,
                                    c.width,
                                ),
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
